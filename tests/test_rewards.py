"""Answer extraction, answer matching, the built-in rewards and the safety of `compute_rewards`."""
import logging, os, sys, threading, time, types
from fractions import Fraction

import numpy as np
import pytest

from maxpost import rewards
from maxpost.config import ConfigError
from maxpost.rewards import (answers_match, check_gold_answers, close_reward_workers, compute_rewards, correctness_reward,
                             extract_answer, format_reward, gold_answer, gsm8k_gold, resolve_reward_fn, RewardSpec,
                             as_reward_specs, start_reward_workers)

@pytest.fixture(autouse=True)
def _end_worker_processes():
    yield
    close_reward_workers()                                              # none left idle for the rest of the suite


# (completion, expected extracted answer), each reasoned out by hand from the documented rules.
EXTRACT_CASES = [
    ("$1,234.50.", "1234.5"),                                     # currency, thousands comma, trailing period
    (r"\boxed{\frac{3}{4}}", "0.75"),                             # \frac supported, canonical decimal
    (r"\boxed{\boxed{5}}", "5"),                                  # nested boxes
    ("So the answer is\n#### -7", "-7"),                          # GSM8K marker, negative
    ("First 3, then 5, finally 12 apples.", "12"),               # last number wins, unit ignored
    ("<answer>12</answer> Later I counted 99.", "12"),            # answer tags win over later numbers
    ("There is no number here.", None),
    ("", None),
    ("<reasoning>2 + 3 = 5</reasoning><answer> 5 </answer>", "5"),
    ("<answer>$1,000</answer>", "1000"),
    ("<answer>1/2</answer>", "0.5"),                              # fractions exact
    ("The answer is .50", "0.5"),                                 # leading-dot decimal
    ("It costs \u20ac12.", "12"),                                 # euro
    ("It costs \u00a33.75 in total.", "3.75"),                    # pound
    ("The temperature is -3 degrees.", "-3"),
    ("She has 10 - 3 = 7 left", "7"),                             # binary minus is not a sign
    ("He ate 25% of it", "25"),                                   # percent sign dropped, value kept
    ("It is 5 dollars", "5"),
    (r"\boxed{-\dfrac{1}{3}}", "-1/3"),                           # non-terminating fraction stays p/q
    (r"\boxed{1{,}000}", "1000"),                                 # LaTeX thousands separator
    (r"\boxed{12\text{ apples}}", "12"),                          # \text units
    ("#### 1,234\n", "1234"),
    (r"so \boxed{4} ... wait, \boxed{5}", "5"),                   # last box wins
    ("<reasoning>3 * 4 = 12</reasoning><answer>13", "13"),        # unclosed answer tag (truncated completion)
    ("<answer>Paris</answer>", "Paris"),                          # non-numeric answers are kept as text
    ("<answer>7</answer> no, <answer>8</answer>", "8"),           # the last tagged answer
    ("#### 72 (that is 8 * 9)\nIt took 5 steps.", "72"),          # the number right after ####, not the last one
    ("pi is about 3.14159", "3.14159"),
    (r"The final value is \boxed 7", "7"),                        # \boxed without braces
    ("x = \u22124", "-4"),                                        # Unicode minus
    ("Try v2 first", None),                                       # a number glued to letters is not a number
    ("It costs $-5", "-5"),
    ("2.50 + 2.50 = 5.00", "5"),                                  # decimals canonicalised
    ("#### -0.50", "-0.5"),
    (r"<answer>\boxed{42}</answer>", "42"),                       # a box inside the tags
    (r"\boxed{\frac{7}{2}} hours", "3.5"),
    ("1/3 of 9 is 3", "3"),
    ("<answer>9 + 4 = 13</answer>", "13"),                        # the last number inside the tags
]

@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected

def test_enough_cases(): assert len(EXTRACT_CASES) >= 25

@pytest.mark.parametrize("field,expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72", "72"),
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10", "10"),
    ("The total is 1000+200 = <<1000+200=1200>>1,200 dollars.\n#### 1,200", "1200"),
    ("He loses 5-8 = <<5-8=-3>>-3\n#### -3", "-3"),
    ("#### 5 ", "5"),
])
def test_gsm8k_gold(field, expected):
    assert gsm8k_gold(field) == expected

@pytest.mark.parametrize("pred,gold,expected", [
    ("0.5", "1/2", True), (".50", "0.5", True), ("1234.5", "1,234.50", True), ("$5", "5", True),
    ("-7", "-7.0", True), ("3/4", "0.75", True), (r"\frac{3}{4}", "3/4", True), ("Paris.", "paris", True),
    ("0.333", "1/3", False), ("7", "-7", False), (None, "1", False), ("1", None, False), ("", "1", False),
    ("0.1", "0.10000000000000001", False),                       # exact, not float, comparison
])
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected

def test_math_verify_path_is_guarded(monkeypatch):
    # Not installed (None in sys.modules makes the import fail): text fallback. With a (fake) math_verify,
    # non-numeric answers go to it; numbers never do.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    assert not answers_match(r"\sqrt{2}", r"2^{1/2}")
    calls = []
    fake = types.SimpleNamespace(parse=lambda s: s, verify=lambda g, p: calls.append((g, p)) or True)
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert answers_match(r"\sqrt{2}", r"2^{1/2}") and len(calls) == 1
    assert not answers_match("3", "4") and len(calls) == 1

def test_correctness_reward():
    comps = ["<reasoning>r</reasoning><answer>7</answer>", "The answer is 7.", "#### 8", "nothing"]
    assert correctness_reward(["p"] * 4, comps, answer=["x\n#### 7", "7", "#### 7", "#### 7"]) == [1.0, 1.0, 0.0, 0.0]

@pytest.mark.parametrize("completion,expected", [
    ("<reasoning>a</reasoning><answer>1</answer>", 1.0),
    ("\n <reasoning>\nline\n</reasoning>\n\n<answer>\n1\n</answer>\n", 1.0),
    ("<reasoning></reasoning><answer>1</answer>", 1.0),
    ("<reasoning>a</reasoning><answer></answer>", 0.0),              # empty answer
    ("<answer>1</answer>", 0.0),
    ("<reasoning>a</reasoning>", 0.0),
    ("x <reasoning>a</reasoning><answer>1</answer>", 0.0),          # text outside the tags
    ("<reasoning>a</reasoning><answer>1</answer> and more", 0.0),
    ("<answer>1</answer><reasoning>a</reasoning>", 0.0),             # wrong order
    ("<reasoning>a</reasoning><answer>1</answer><answer>2</answer>", 0.0),
    ("<reasoning>a<answer>1</answer></reasoning><answer>1</answer>", 0.0),
    ("<reasoning>a</reasoning><answer>1", 0.0),                      # truncated
])
def test_format_reward(completion, expected):
    assert format_reward(["p"], [completion]) == [expected]

def _boom(prompts, completions, **_):
    if any("boom" in c for c in completions): raise RuntimeError("boom")
    return [1.0] * len(completions)

def test_failing_and_slow_functions_score_zero_and_are_counted():
    def sleepy(prompts, completions, **_): time.sleep(30); return [1.0] * len(completions)
    def weird(prompts, completions, **_): return [1.0, None, float("nan"), "x"]
    def short(prompts, completions, **_): return []              # wrong length, also item by item
    comps = ["<reasoning>r</reasoning><answer>3</answer>", "boom", "3", "4"]
    t0 = time.perf_counter()
    total, per, m = compute_rewards([("correctness", 2.0), _boom, sleepy, weird, short], ["p"] * 4, comps,
                                    {"answer": ["#### 3"] * 4}, timeout_s=1.0)
    assert time.perf_counter() - t0 < 15                    # did not wait for the 30 s sleeper
    np.testing.assert_array_equal(per["correctness"], [1, 0, 1, 0])
    np.testing.assert_array_equal(per["_boom"], [1, 0, 1, 1]); assert m["rewards/_boom/failures"] == 1
    np.testing.assert_array_equal(per["sleepy"], [0, 0, 0, 0])
    assert m["rewards/sleepy/failures"] == 4 and m["rewards/sleepy/timeout"] == 1 and m["rewards/_boom/timeout"] == 0
    np.testing.assert_array_equal(per["weird"], [1, 0, 0, 0]); assert m["rewards/weird/failures"] == 3
    np.testing.assert_array_equal(per["short"], [0, 0, 0, 0]); assert m["rewards/short/failures"] == 4
    np.testing.assert_allclose(total, 2 * per["correctness"] + per["_boom"] + per["weird"])
    assert m["rewards/failures"] == 1 + 4 + 3 + 4
    assert m["rewards/correctness/mean"] == pytest.approx(0.5)

def test_columns_by_name_and_validation():
    seen = {}
    def named(prompts, completions, level): return [float(x) for x in level]
    def kwargs(prompts, completions, **columns): seen.update(columns); return [0.0] * len(completions)
    total, per, _ = compute_rewards([named, kwargs], ["a", "b"], ["x", "y"], {"level": [1, 2], "other": ["u", "v"]},
                                    isolation="thread")                 # `kwargs` records what it saw: shared memory
    np.testing.assert_array_equal(per["named"], [1, 2]); assert seen == {"level": [1, 2], "other": ["u", "v"]}
    def sizes(prompts, completions, **columns): return [float(len(columns["other"][i])) for i in range(len(completions))]
    _, per, _ = compute_rewards([named, sizes], ["a", "b"], ["x", "y"], {"level": [1, 2], "other": ["u", "vw"]})
    np.testing.assert_array_equal(per["named"], [1, 2]); np.testing.assert_array_equal(per["sizes"], [1, 2])  # in a process
    with pytest.raises(ValueError, match="rows"): compute_rewards("format", ["a"], ["x"], {"level": [1, 2]})
    with pytest.raises(ValueError, match="prompts"): compute_rewards("format", ["a", "b"], ["x"])
    with pytest.raises(ValueError, match="clashes"): compute_rewards("format", ["a"], ["x"], {"prompts": ["a"]})
    total, per, m = compute_rewards("format", [], [])
    assert total.shape == (0,) and m["rewards/failures"] == 0

def test_resolve_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
        "class Holder:\n    @staticmethod\n    def half(prompts, completions, **kw): return [0.5] * len(completions)\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward_fn("my_rewards:length_reward")
    assert fn([""], ["abc"]) == [3.0]
    assert resolve_reward_fn("my_rewards.length_reward") is fn
    assert resolve_reward_fn("my_rewards:Holder.half")(["p"], ["c"]) == [0.5]
    assert resolve_reward_fn("correctness") is correctness_reward and resolve_reward_fn("format") is format_reward
    total, per, m = compute_rewards({"my_rewards:length_reward": 0.5, "format": 1.0}, ["p", "p"], ["ab", "abcd"])
    np.testing.assert_allclose(total, [1.0, 2.0]); assert set(per) == {"length_reward", "format"}
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"): resolve_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no attribute"): resolve_reward_fn("my_rewards:missing")
    with pytest.raises(ValueError, match="built-in"): resolve_reward_fn("correctnes")
    with pytest.raises(TypeError, match="not a callable"): resolve_reward_fn("my_rewards:NOT_CALLABLE")

def test_reward_specs():
    specs = as_reward_specs([RewardSpec("format", 0.5), {"fn": "correctness", "weight": 2, "name": "acc"}, (format_reward, 1, "fmt2")])
    assert [(s.name, s.weight) for s in specs] == [("format", 0.5), ("acc", 2.0), ("fmt2", 1.0)]
    assert [s.name for s in as_reward_specs(correctness_reward)] == ["correctness_reward"]
    with pytest.raises(ValueError, match="unique"): as_reward_specs([format_reward, format_reward])


# ---------------------------------------------------------------- gold answers


@pytest.mark.parametrize("field,expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,500", "1500"),
    (r"We get $x = \boxed{\frac{3}{4}}$.", "0.75"),                   # a MATH solution: its boxed answer
    (r"so \boxed{\dfrac{1}{2}} cups", "0.5"),
    ("12", "12"), ("-0.5", "-0.5"), (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"), (r"\text{(C)}", r"\text{(C)}"),
    ("Monday", "Monday"), ("New York City", "New York City"), ("x^2 + 7x + 10", "x^2 + 7x + 10"),
    ("Natalia sold 72 clips.", None),                                   # a sentence is not an answer
    ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.", None),   # GSM8K without ####
    ("She sold forty-eight clips in April and twenty-four in May", None),
    ("#### ", None), ("", None), (None, None),
])
def test_gold_answer(field, expected):
    assert gold_answer(field) == expected


def test_check_gold_answers_refuses_a_column_without_final_answers():
    sentences = ["Natalia sold 72 clips.", "Weng earned 10 dollars.", "The answer is seven apples."] * 3 + ["#### 4"]
    with pytest.raises(ConfigError, match=r"column 'answer': only 1 of 10 gold answers have a final answer.*"
                                          r"row 0 is 'Natalia sold 72 clips\.'.*answer_column="):
        check_gold_answers(sentences)
    with pytest.raises(ConfigError, match="column 'solution'"):
        check_gold_answers(sentences, column="solution")
    # GSM8K, MATH-style short answers and boxed solutions all pass; so does a minority of sentences
    assert check_gold_answers(["x\n#### 72", "#### 5"]) == "column 'answer': 2 of 2 gold answers have a final answer (2 marked with '####')"
    assert check_gold_answers([r"\frac{1}{2}", "10", r"so \boxed{3}", "Monday"]).startswith("column 'answer': 4 of 4")
    assert check_gold_answers(sentences[:3] + ["1", "2", "3", "4"]).startswith("column 'answer': 4 of 7")
    with pytest.raises(ConfigError): check_gold_answers(sentences[:3] + ["1"], min_share=0.5)
    assert check_gold_answers([]).startswith("column 'answer': 0 of 0")
    # without the check, such a column scores every completion 0: the failure the check exists for
    assert correctness_reward(["p"], ["<answer>72</answer>"], answer=["Natalia sold 72 clips."]) == [0.0]


# ---------------------------------------------------------------- what a reward function returns


def one_score(prompts, completions, **_): return [1.0]
def a_float(prompts, completions, **_): return 1.0
def not_finite(prompts, completions, **_): return [1.0, float("nan"), float("inf"), "0.5"][:len(completions)]
def exits(prompts, completions, **_):
    if any("exit" in c for c in completions): raise SystemExit(3)
    return [1.0] * len(completions)
def interrupts(prompts, completions, **_): raise KeyboardInterrupt


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_wrong_length_fails_the_whole_batch(isolation, caplog):
    with caplog.at_level(logging.WARNING, logger="maxpost.rewards"):
        total, per, m = compute_rewards([one_score, a_float], ["p"] * 4, ["a", "b", "c", "d"], isolation=isolation)
    np.testing.assert_array_equal(per["one_score"], [0, 0, 0, 0])      # not 1.0 for every item after a retry
    np.testing.assert_array_equal(per["a_float"], [0, 0, 0, 0])
    assert m["rewards/one_score/failures"] == 4 and m["rewards/a_float/failures"] == 4 and m["rewards/failures"] == 8
    assert "returned 1 score(s) for 4 completions" in caplog.text and "returned a float, not a list" in caplog.text
    # a batch of one is the right length
    assert compute_rewards(one_score, ["p"], ["a"], isolation=isolation)[1]["one_score"].tolist() == [1.0]
    close_reward_workers([one_score, a_float])


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_values_that_are_not_finite_numbers_warn(isolation, caplog):
    with caplog.at_level(logging.WARNING, logger="maxpost.rewards"):
        _, per, m = compute_rewards(not_finite, ["p"] * 4, ["a"] * 4, isolation=isolation)
    np.testing.assert_array_equal(per["not_finite"], [1, 0, 0, 0]); assert m["rewards/not_finite/failures"] == 3
    assert "reward 'not_finite' returned 3 value(s) that are not finite numbers (e.g. nan)" in caplog.text
    close_reward_workers(not_finite)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_system_exit_and_keyboard_interrupt_in_a_reward_are_failures(isolation):
    comps = ["ok", "exit", "ok"]
    for _ in range(2):                                                  # and the worker keeps working afterwards
        _, per, m = compute_rewards([exits, interrupts], ["p"] * 3, comps, isolation=isolation, timeout_s=30)
        np.testing.assert_array_equal(per["exits"], [1, 0, 1]); assert m["rewards/exits/failures"] == 1
        np.testing.assert_array_equal(per["interrupts"], [0, 0, 0]); assert m["rewards/interrupts/failures"] == 3
    close_reward_workers([exits, interrupts])


def test_metric_names_follow_trl_without_duplicates():
    _, _, m = compute_rewards({"correctness": 1.0, "format": 0.5}, ["p"], ["<answer>1</answer>"], {"answer": ["1"]})
    per = {f"rewards/{n}/{k}" for n in ("correctness", "format") for k in ("mean", "std", "failures", "timeout", "seconds")}
    assert set(m) == per | {"rewards/failures"}                       # no rewards/total/*: the trainer logs reward, reward_std


# ---------------------------------------------------------------- a reward function that hangs


def spin(prompts, completions, **_):
    if any("loop" in c for c in completions):
        while True: pass
    return [float(len(c)) for c in completions]


def _alive(pid):
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    return True


def test_a_stuck_reward_is_stopped_and_nothing_leaks():
    specs = start_reward_workers([spin])
    threads, pids = threading.active_count(), []
    for _ in range(3):                                                  # one stuck call per step
        pids.append(rewards._runners(specs[0])["process"].proc.pid)  # the worker this call goes to
        _, per, m = compute_rewards(specs, ["p"] * 2, ["a loop", "b"], timeout_s=0.5)
        assert m["rewards/spin/timeout"] == 1 and m["rewards/spin/failures"] == 2
        assert threading.active_count() == threads                     # no thread left spinning in the trainer
        assert not _alive(pids[-1])                                     # the stuck worker process is gone
    _, per, m = compute_rewards(specs, ["p"] * 2, ["abc", "de"], timeout_s=30)   # the fresh worker scores again
    np.testing.assert_array_equal(per["spin"], [3, 2]); assert m["rewards/spin/timeout"] == 0
    close_reward_workers(specs)


def test_in_a_thread_a_stuck_reward_is_not_called_again_until_it_returns():
    release, calls = threading.Event(), []
    def blocks(prompts, completions, **_):
        calls.append(list(completions))
        if "block" in completions: release.wait(60)
        return [1.0] * len(completions)
    specs, threads = as_reward_specs(blocks), threading.active_count()
    _, _, m = compute_rewards(specs, ["p"], ["block"], timeout_s=0.2, isolation="thread")
    assert m["rewards/blocks/timeout"] == 1 and len(calls) == 1
    for _ in range(3):                                                  # not called while the first call still runs
        _, per, m = compute_rewards(specs, ["p"], ["x"], timeout_s=0.2, isolation="thread")
        assert m["rewards/blocks/timeout"] == 1 and per["blocks"].tolist() == [0.0] and len(calls) == 1
    assert threading.active_count() == threads + 1                     # one stuck thread, not one per step
    release.set(); time.sleep(0.2)
    _, per, m = compute_rewards(specs, ["p"], ["x"], timeout_s=5, isolation="thread")
    assert per["blocks"].tolist() == [1.0] and len(calls) == 2


def test_a_function_that_cannot_be_pickled_runs_in_a_thread(caplog):
    lock = threading.Lock()                                             # a lock does not pickle, even with cloudpickle
    def locked(prompts, completions, **_):
        with lock: return [2.0] * len(completions)
    with caplog.at_level(logging.WARNING, logger="maxpost.rewards"):
        _, per, _ = compute_rewards(locked, ["p"], ["a"])
    assert per["locked"].tolist() == [2.0] and "runs in a thread, not a worker process" in caplog.text


def test_a_reward_module_in_the_working_directory(tmp_path, monkeypatch):
    # the console script does not put the current directory on sys.path; resolve_reward_fn looks there last
    (tmp_path / "cwd_rewards.py").write_text("def half(prompts, completions, **kw): return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = resolve_reward_fn("cwd_rewards:half")
    assert fn(["p"], ["c"]) == [0.5] and sys.path[-1] == str(tmp_path)
    _, per, _ = compute_rewards("cwd_rewards:half", ["p"], ["c"])        # and its worker process finds it too
    assert per["half"].tolist() == [0.5]
    close_reward_workers(fn)
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_rewards'.*current directory.*PYTHONPATH="):
        resolve_reward_fn("no_such_rewards:fn")
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1


# Replies in the way instruct models write them (SmolLM2-, Qwen2.5-, Llama-3-Instruct styles) with the gold answer
# each states; the last number of each is a different number, so a fall-back to the last number fails every case.
INSTRUCT_REPLIES = [
    ("Janet has 16 eggs. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 eggs are left.\nShe sells them at $2 each: "
     "9 x 2 = 18.\nThe answer is 18. She sold 9 eggs in 1 day.", "18"),
    ("To find the total, multiply: 12 * 5 = 60 minutes.\n\nThe final answer is: $60$ (about 1 hour).", "60"),
    ("First, 3 boxes of 24 pencils is 72 pencils. Then 72 / 8 = 9.\n\n**Answer:** 9 pencils per student, "
     "for 8 students.", "9"),
    ("Step 1: 1,200 + 300 = 1,500\nStep 2: 1,500 x 2 = 3,000\nAnswer: $3,000 over 2 years", "3000"),
    (r"We have $\frac{3}{4} \cdot 20 = 15$ apples.\nSo the answer is $\boxed{15}$. Check: 15 + 5 = 20.", "15"),
    ("She earns 10 dollars per hour for 4 hours: 10 * 4 = 40.\n#### 40\nThat is 2 more than 38.", "40"),
    ("The answer is -7 degrees, down from 3.", "-7"),
]

@pytest.mark.parametrize("reply,gold", INSTRUCT_REPLIES, ids=[f"reply{i}" for i in range(len(INSTRUCT_REPLIES))])
def test_extract_answer_reads_what_instruct_models_write(reply, gold):
    from maxpost.rewards import last_number
    assert last_number(reply) != gold                       # the case is not won by the last number
    assert extract_answer(reply) == gold
    assert correctness_reward(["q"], [reply], answer=[f"...\n#### {gold}"]) == [1.0]


def test_format_rewards_follow_the_prompt_template():
    from maxpost.rewards import format_reward_for, plain_format_reward, boxed_format_reward, marked_format_reward
    stated, boxed, hashes, bare = INSTRUCT_REPLIES[0][0], r"So it is $\boxed{15}$.", "3 + 4\n#### 7", "It is 7 apples."
    tags = "<reasoning>3 + 4 = 7</reasoning><answer>7</answer>"
    assert format_reward_for("plain") is plain_format_reward and format_reward_for("boxed") is boxed_format_reward
    assert format_reward_for("gsm8k") is format_reward and format_reward_for("{question} Go.") is marked_format_reward
    replies = [stated, boxed, hashes, bare, tags]
    assert plain_format_reward(None, replies) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert boxed_format_reward(None, replies) == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert marked_format_reward(None, replies) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert format_reward(None, replies) == [0.0, 0.0, 0.0, 0.0, 1.0]
    # a correct reply in the template's form scores on both rewards
    assert correctness_reward(["q"], [stated], answer=["#### 18"]) == [1.0] and plain_format_reward(None, [stated]) == [1.0]
