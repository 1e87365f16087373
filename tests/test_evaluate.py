"""Evaluation: pass@k / maj@k arithmetic against subset enumeration and hand-computed values, the batching of
`evaluate` (through a fake sampler), prompts rendered exactly once and exactly like SFT's, GSM8K files through
`datasets`, clear errors, and `maxpost eval` on the run directory of a short `maxpost sft`."""
import itertools, json, os, re, subprocess, sys
from pathlib import Path

import numpy as np, pytest

from maxpost import tasks, sampling
from maxpost.config import load_config, ConfigError
from maxpost.data import encode_chat
from maxpost.prompts import PROMPT_TEMPLATES, render_prompt, prompt_token_ids, stop_token_ids
from maxpost.evaluate import (load_eval_examples,
                              pass_at_k, majority_vote, score_samples, evaluate, format_table)
from maxpost.eval_command import main
from maxpost.rewards import gsm8k_gold, correctness_reward, format_reward

ROOT = Path(__file__).resolve().parent.parent


def A(x):
    return f"<reasoning>work</reasoning><answer>{x}</answer>"


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


# ---------------------------------------------------------------------------------------------- the arithmetic

@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # 1 - C(n-c, k) / C(n, k) with exact integers, where floats of the binomials would overflow
    from fractions import Fraction
    from math import comb
    for n, c, k in [(2000, 3, 100), (2000, 1500, 1000), (500, 0, 250)]:
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)


def test_majority_vote_groups_equal_values_skips_abstentions_and_breaks_ties_by_first_appearance():
    assert majority_vote(["1", "2", "3"]) == "1"
    assert majority_vote(["3", "2", "2", "3"]) == "3"
    assert majority_vote([None, "5", None, None]) == "5"            # three abstentions do not outvote one answer
    assert majority_vote(["0.5", "8", "1/2", "8", "0.50"]) in ("0.5", "1/2", "0.50")   # 3 votes for one half
    assert majority_vote([None, None, None]) is None
    assert majority_vote([]) is None


def test_score_samples_on_hand_made_completions():
    golds = ["4", "10", "6", "2", "0.5"]
    greedy = [A(4), A(9), "so the answer is 6", A(2), "<answer>1/2</answer>"]
    samples = [[A(4), A(5), A(5)],                   # one right; the vote (5) wrong
               [A(10), A(10), "no answer here"],     # two right, one abstains; the vote right
               [A(1), A(2), A(3)],                   # none right; a three-way tie goes to the first, 1
               ["x", "y", "z"],                      # every sample abstains
               [A("0.5"), A("1/2"), A(7)]]           # 0.5 and 1/2 vote together
    s = score_samples(greedy, samples, golds, k=3)
    assert s["num_prompts"] == 5
    assert s["pass@1"] == pytest.approx(4 / 5)       # greedy: 4 (tags), 6 (last number), 2, 1/2 are right
    assert s["format_rate"] == pytest.approx(3 / 5)  # A(4), A(9), A(2); the <answer>-only one lacks <reasoning>
    assert s["pass@3"] == pytest.approx(3 / 5)
    assert s["maj@3"] == pytest.approx(2 / 5)
    assert s["sample_accuracy"] == pytest.approx((1 / 3 + 2 / 3 + 0 + 0 + 2 / 3) / 5)


def test_score_samples_with_more_samples_than_k():
    # 4 samples, k = 2: pass@2 is the unbiased estimate over the 4 (not "any of the first 2"), maj@2 votes the first 2
    samples = [[A(1), A(9), A(9), A(9)], [A(9), A(1), A(1), A(9)]]
    s = score_samples([A(1), A(1)], samples, ["1", "1"], k=2)
    p1 = 1 - 3 / 6            # c = 1 of n = 4: 3 of the 6 pairs miss it
    p2 = 1 - 1 / 6            # c = 2 of n = 4: 1 of the 6 pairs misses both
    assert s["pass@2"] == pytest.approx((p1 + p2) / 2)
    assert s["maj@2"] == pytest.approx(1 / 2)        # prompt 1: [1, 9] tie -> 1 (right); prompt 2: [9, 1] -> 9 (wrong)
    assert s["sample_accuracy"] == pytest.approx((1 / 4 + 2 / 4) / 2)


def test_score_samples_rejects_mismatched_inputs():
    with pytest.raises(ValueError): score_samples([A(1)], None, ["1", "2"], k=0)
    with pytest.raises(ValueError): score_samples([A(1)], [[A(1)]], ["1"], k=2)       # fewer than k samples


# ------------------------------------------------------------------------- evaluate, through a fake sampler

GOLDS = ["4", "10", "6", "2", "0.5"]
GREEDY = [A(4), A(9), "so the answer is 6", A(2), "<answer>1/2</answer>"]
GREEDY_LEN = [3, 5, 16, 7, 2]                       # row 2 never stops: truncated at max_completion_length=16
SAMPLES = [[A(4), A(5), A(5)], [A(10), A(10), "no answer here"], [A(1), A(2), A(3)], ["x", "y", "z"],
           [A("0.5"), A("1/2"), A(7)]]


def test_evaluate_batches_pads_and_maps_completions_back_to_their_prompts(tok, monkeypatch):
    stop = stop_token_ids(tok)[0]
    calls = []

    def fake_generate(model, prompt_ids, *, max_prompt_length, max_completion_length, num_generations=1,
                      temperature=1.0, top_k=0, top_p=1.0, eos_ids=(), pad_id=0, seed=0, tokenizer=None, **_):
        assert list(eos_ids) == [stop] and tokenizer is tok
        calls.append((len(prompt_ids) * num_generations, temperature, top_k, top_p, seed))
        texts, ids, mask = [], [], []
        for p in prompt_ids:
            i = int(re.search(r"question number (\d+)", tok.decode(p)).group(1))
            for g in range(num_generations):
                texts.append(GREEDY[i] if temperature == 0 else SAMPLES[i][g])
                n = GREEDY_LEN[i] if temperature == 0 else 4
                row = np.full(max_completion_length, 7, np.int32)
                if n < max_completion_length or i != 2: row[n - 1] = stop
                m = (np.arange(max_completion_length) < n).astype(np.int32)
                ids.append(row); mask.append(m)
        B = len(texts)
        return sampling.Rollout(np.zeros((B, 4), np.int32), np.ones((B, 4), np.int32), np.stack(ids), np.stack(mask),
                                np.zeros((B, max_completion_length), np.float32), texts, 0)

    monkeypatch.setattr(sampling, "generate", fake_generate)
    examples = [{"question": f"question number {i}", "answer": g} for i, g in enumerate(GOLDS)]
    r = evaluate(None, tok, examples, k=3, batch_size=2, max_prompt_length=64, max_completion_length=16,
                 temperature=0.7, top_k=5, top_p=0.9, seed=3, return_completions=True)
    # every call has batch_size * k = 6 rows: one greedy call (5 prompts + 1 pad), three sampling calls (2 prompts x 3)
    assert [c[0] for c in calls] == [6, 6, 6, 6]
    assert calls[0][1] == 0.0 and all(c[1:4] == (0.7, 5, 0.9) for c in calls[1:])
    assert len({c[4] for c in calls[1:]}) == 3                       # each sampling chunk its own seed
    assert r["pass@1"] == pytest.approx(4 / 5) and r["format_rate"] == pytest.approx(3 / 5)
    assert r["pass@3"] == pytest.approx(3 / 5) and r["maj@3"] == pytest.approx(2 / 5)
    assert r["sample_accuracy"] == pytest.approx(1 / 3)
    assert r["mean_completion_length"] == pytest.approx(np.mean(GREEDY_LEN))
    assert r["truncation_rate"] == pytest.approx(1 / 5)
    assert [c["completion"] for c in r["completions"]] == GREEDY
    assert [c["correct"] for c in r["completions"]] == [True, False, True, True, True]
    assert [c["extracted"] for c in r["completions"]] == ["4", "9", "6", "2", "0.5"]

    calls.clear()                                  # k = 0: greedy only, batch_size prompts per call
    r0 = evaluate(None, tok, examples, k=0, batch_size=2, max_prompt_length=64, max_completion_length=16)
    assert [c[0] for c in calls] == [2, 2, 2] and "pass@3" not in r0 and r0["pass@1"] == pytest.approx(4 / 5)


def test_greedy_completions_do_not_depend_on_batching(tok):
    from maxpost.model import get_model_config, create_model
    model = create_model(get_model_config("tiny", num_layers=1, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                          mlp_dim=128), seed=1)
    examples = [dict(e, answer=gsm8k_gold(e["answer"])) for e in tasks.generate_problems(5, seed=0, split="test")]
    kw = dict(k=0, max_prompt_length=96, max_completion_length=8, return_completions=True)
    a = evaluate(model, tok, examples, batch_size=5, **kw)["completions"]
    b = evaluate(model, tok, examples, batch_size=2, **kw)["completions"]
    assert [c["completion"] for c in a] == [c["completion"] for c in b]
    # and they are what a direct greedy call gives for each prompt alone
    for i in (0, 3):
        one = sampling.generate(model, prompt_token_ids(tok, [examples[i]["question"]]), max_prompt_length=96,
                                max_completion_length=8, temperature=0.0, eos_ids=stop_token_ids(tok),
                                pad_id=tok.pad_token_id, tokenizer=tok)
        assert one.text[0] == a[i]["completion"]


# ------------------------------------------------------------------------------------------------- prompts

def test_gsm8k_prompt_is_the_prompt_part_of_the_sft_conversation(tok):
    for ex in tasks.generate_problems(5, seed=3, split="test"):
        conv = tasks.sft_messages(ex)
        text = render_prompt(tok, ex["question"])
        assert text == tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
        assert text.count("<|im_start|>") == 3 and text.endswith("<|im_start|>assistant\n")
        assert tasks.SYSTEM_PROMPT in text and PROMPT_TEMPLATES["gsm8k"] == tasks.SYSTEM_PROMPT
        # the tokens SFT trained on: the prompt is exactly the untrained prefix of the conversation
        ids = prompt_token_ids(tok, [ex["question"]])[0]
        conv_ids, loss_mask = encode_chat(tok, conv)
        assert conv_ids[:len(ids)] == ids
        assert not any(loss_mask[:len(ids)]) and loss_mask[len(ids)] == 1


def test_custom_template_is_the_user_turn_wrapped_once(tok):
    text = render_prompt(tok, "What is 2+3?", "Solve: {question}\nEnd with {a} in braces.")
    assert text == "<|im_start|>user\nSolve: What is 2+3?\nEnd with {a} in braces.<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, "Q?", "question") == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"\{question\}"): render_prompt(tok, "Q?", "gsm8")


def test_no_double_bos_and_plain_text_without_a_chat_template():
    from tokenizers import processors
    t = tasks.build_tokenizer()
    bos = "<|endoftext|>"
    bos_id = t.convert_tokens_to_ids(bos)
    t.bos_token = bos
    t._tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    assert t("hi")["input_ids"][0] == bos_id                       # this tokenizer adds a BOS by itself ...
    t.chat_template = "{{ bos_token }}" + tasks.CHAT_TEMPLATE       # ... and so does its chat template
    ids = prompt_token_ids(t, ["What is 1+1?"])[0]
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    t.chat_template = None                                        # a base model: plain text, the tokenizer's BOS once
    text = render_prompt(t, "What is 1+1?")
    assert text == tasks.SYSTEM_PROMPT + "\n\nWhat is 1+1?\n" and "<|im_start|>" not in text
    ids = prompt_token_ids(t, ["What is 1+1?"])[0]
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    assert t.decode(ids[1:]) == text


def test_stop_tokens(tok):
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    from transformers import PreTrainedTokenizerFast
    t = PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>")   # EOS != end of turn
    assert stop_token_ids(t) == [t.convert_tokens_to_ids("<|endoftext|>"), t.convert_tokens_to_ids("<|im_end|>")]


# ---------------------------------------------------------------------------------------------------- data

def _cfg(tmp_path, *overrides):
    "An eval config; a single data file has one split, `train`."
    return load_config("eval", [f"base_output_directory={tmp_path}", "eval_split=train", *overrides], base=None)


GSM8K_ROWS = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
               "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
              {"question": "A house costs 1,200 dollars and the garden 300. Total?", "answer": "1200+300=1500\n#### 1,500"},
              {"question": "Half of 5?", "answer": "#### 2.5"},
              {"question": "Unused?", "answer": "#### 1"}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_gsm8k_file_loads_through_datasets_with_golds(tmp_path, fmt):
    import datasets
    path = tmp_path / f"gsm8k_test.{fmt}"
    if fmt == "jsonl": path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    else: datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(path))
    ex = load_eval_examples(_cfg(tmp_path, f"dataset_name={path}", "eval_num_prompts=3"))
    assert [e["question"] for e in ex] == [r["question"] for r in GSM8K_ROWS[:3]]
    assert [e["answer"] for e in ex] == ["72", "1500", "2.5"]
    assert load_eval_examples(_cfg(tmp_path, f"dataset_name={path}", "eval_num_prompts=100"))[-1]["answer"] == "1"


def test_other_column_names_keep_the_original_columns(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"problem": r["question"], "solution": r["answer"], "id": i}) + "\n"
                            for i, r in enumerate(GSM8K_ROWS)))
    ex = load_eval_examples(_cfg(tmp_path, f"dataset_name={path}", "question_column=problem",
                                 "answer_column=solution", "eval_num_prompts=2"))
    assert [(e["id"], e["answer"], e["solution"]) for e in ex] == [(0, "72", GSM8K_ROWS[0]["answer"]),
                                                                   (1, "1500", GSM8K_ROWS[1]["answer"])]


def test_missing_column_is_a_clear_error(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["question"], "answer": r["answer"]}) + "\n" for r in GSM8K_ROWS))
    with pytest.raises(ConfigError) as e:
        load_eval_examples(_cfg(tmp_path, f"dataset_name={path}"))
    msg = str(e.value)
    assert "'question'" in msg and "columns found" in msg and "'prompt'" in msg and "question_column" in msg


def test_main_requires_load_parameters_path(tmp_path):
    with pytest.raises(ConfigError, match="load_parameters_path"):
        main([f"base_output_directory={tmp_path}", "load_parameters_path="])


def test_format_table_aligns_rows_and_columns():
    t = format_table({"a": {"pass@1": 0.25, "maj@8": 0.5, "completions": []}, "longer-label": {"pass@1": 1.0, "n": 3}})
    lines = t.splitlines()
    assert lines[0].split() == ["pass@1", "maj@8", "n"]
    assert lines[2].split() == ["a", "25.0", "%", "50.0", "%", "-"]                      # shares in % (issue 43 item 8)
    assert lines[3].split() == ["longer-label", "100.0", "%", "-", "3"]
    assert format_table({"a": {"kl": 0.25}}).splitlines()[2].split() == ["a", "0.250"]    # other floats stay as they are
    assert len({len(l) for l in lines}) == 1


# ------------------------------------------------------------------------------------ maxpost sft -> maxpost eval

def _cmd(command, module):
    "`python -m maxpost.cli <command>`, or the module's main directly while the CLI does not list the command yet."
    from maxpost.cli import commands
    if command in commands(): return [sys.executable, "-m", "maxpost.cli", command]
    return [sys.executable, "-c", f"import sys; from {module} import main; raise SystemExit(main(sys.argv[1:]))"]


def test_cli_eval_on_a_short_sft_run(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    sft = _cmd("sft", "maxpost.sft") + [f"base_output_directory={tmp_path}", "run_name=sft", "steps=3", "model_name=tiny",
                                        "global_batch_size=8", "max_target_length=96", "eval_batches=1", "warmup_steps=1"]
    r = subprocess.run(sft, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    args = [f"base_output_directory={tmp_path}", f"load_parameters_path={tmp_path / 'sft'}",
            "eval_num_prompts=8", "eval_k=2", "max_completion_length=16"]
    r = subprocess.run(_cmd("eval", "maxpost.evaluate") + args, env=env, capture_output=True, text=True, timeout=900,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    header = next(l for l in r.stdout.splitlines() if "pass@1" in l).split()
    for col in ("pass@1", "pass@2", "maj@2", "format_rate", "truncation_rate", "mean_completion_length"):
        assert col in header, r.stdout
    assert any(l.startswith("sft ") for l in r.stdout.splitlines()), r.stdout
    assert not (tmp_path / "sft" / "eval.json").exists()            # nothing written into the evaluated run
    rec = json.loads((tmp_path / "eval-sft" / "eval.json").read_text())
    m, comps = rec["metrics"], rec["completions"]
    assert rec["step"] == 3 and m["num_prompts"] == 8 and len(comps) == 8
    # the first 8 questions of the embedded test split (the test split is drawn first, so these are its head)
    expected = tasks.generate_problems(8, seed=0, split="test")
    assert [c["question"] for c in comps] == [e["question"] for e in expected]
    assert [c["answer"] for c in comps] == [gsm8k_gold(e["answer"]) for e in expected]
    # the metrics are those of the stored greedy completions, recomputed with the reward functions
    texts = [c["completion"] for c in comps]
    assert m["pass@1"] == pytest.approx(np.mean(correctness_reward([""] * 8, texts, [e["answer"] for e in expected])))
    assert m["format_rate"] == pytest.approx(np.mean(format_reward([""] * 8, texts)))
    assert 0 <= m["maj@2"] <= m["pass@2"] <= 1 and 0 < m["mean_completion_length"] <= 16
    recs = [json.loads(l) for l in (tmp_path / "eval-sft" / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in recs] == ["eval"] and recs[0]["step"] == 3 and recs[0]["pass@2"] == m["pass@2"]
    # the embedded examples loaded in-process from the same place agree
    ex = load_eval_examples(_cfg(tmp_path, "eval_num_prompts=8", "eval_split=test"))
    assert [e["question"] for e in ex] == [c["question"] for c in comps]
    # another checkpoint whose directory has the same name: its evaluation lands beside the first, which stays
    import shutil
    shutil.copytree(tmp_path / "sft", tmp_path / "copy" / "sft")
    args2 = [a.replace(str(tmp_path / "sft"), str(tmp_path / "copy" / "sft")) for a in args]
    r = subprocess.run(_cmd("eval", "maxpost.evaluate") + args2, env=env, capture_output=True, text=True, timeout=900,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {p.parent.name: json.loads(p.read_text())["load_parameters_path"] for p in tmp_path.glob("eval-sft*/eval.json")}
    assert recs.get("eval-sft") == str(tmp_path / "sft") and len(recs) == 2, recs
    other = next(k for k in recs if k != "eval-sft")
    assert recs[other] == str(tmp_path / "copy" / "sft") and f"{other}/eval.json" in r.stdout, (recs, r.stdout[-500:])


def test_eval_writes_into_its_own_directory_never_a_training_run(tmp_path):
    """issue 21, item 14: `maxpost eval` as README shows it (no run_name) must not write into the RL run's directory."""
    from maxpost.eval_command import eval_dir
    base = [f"base_output_directory={tmp_path}", f"load_parameters_path={tmp_path / 'embedded-sft'}"]
    assert eval_dir(load_config("eval", base)) == tmp_path / "eval-embedded-sft"
    assert eval_dir(load_config("eval", [*base[:1], f"load_parameters_path={tmp_path}/r/checkpoints/30"])) == tmp_path / "eval-r@30"
    (tmp_path / "embedded-grpo" / "checkpoints").mkdir(parents=True)
    (tmp_path / "embedded-sft").mkdir()   # (a load_parameters_path that does not exist would be named first)
    with pytest.raises(ConfigError, match="training run's directory"):
        eval_dir(load_config("eval", [*base, "run_name=embedded-grpo"]))
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", "eval", *base, "run_name=embedded-grpo"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "training run's directory" in r.stderr, r.stderr[-2000:]
    assert list((tmp_path / "embedded-grpo").iterdir()) == [tmp_path / "embedded-grpo" / "checkpoints"]


# ------------------------------------------------------------------------ evaluating episodes (environment=, issue 42)

def _tool_reader(problems):
    "A scripted policy: the calculator calls of each problem's demonstration, then as its answer the last tool output it was shown."
    from maxpost.environments import ScriptedEngine
    ctok = tasks.build_calculator_tokenizer()
    def respond(context):
        demo = tasks.calculator_messages(next(p for p in problems if p["question"] in context))
        calls = [m["content"] for m in demo if m["role"] == "assistant"][:-1]
        turn = context.count("<|im_start|>assistant") - 1
        if turn < len(calls): return calls[turn]
        shown = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", context, re.S)
        return f"<reasoning>read</reasoning><answer>{shown[-1] if shown else 'none'}</answer>"
    return ScriptedEngine(ctok, respond), ctok


def test_evaluate_episodes_scores_the_answer_built_on_the_tools_outputs():
    """pass@1 is 1 only if every call ran and its output came back to the policy as a tool message (the answer is the
    last output it was shown); a tool that answers wrongly, or an environment that does not pass outputs back, scores 0."""
    from maxpost.environments import ToolEnvironment, Toolbox, calculator, calculator_environment
    from maxpost.evaluate import evaluate_episodes
    problems = [p for p in tasks.generate_problems(12, seed=3, split="test") if " = " in p["answer"]][:4]
    examples = [dict(p, answer=gsm8k_gold(p["answer"])) for p in problems]
    engine, ctok = _tool_reader(problems)
    kw = dict(k=2, max_prompt_length=96, max_turns=6, max_turn_tokens=48, max_episode_tokens=256, batch_size=3)
    res = evaluate_episodes(engine, ctok, examples, calculator_environment, **kw)
    steps = [p["answer"].count(" = ") for p in problems]
    assert res["pass@1"] == 1.0 and res["pass@2"] == 1.0 and res["tool_use"] == 1.0 and res["tool_errors"] == 0
    assert res["tool_calls"] == pytest.approx(np.mean(steps)) and res["turns"] == pytest.approx(np.mean(steps) + 1)

    def calculator_off_by_one(expression: str) -> str:
        """A calculator that is wrong by one.

        Args:
            expression: the expression
        """
        return str(int(calculator(expression)) + 1)
    calculator_off_by_one.__name__ = "calculator"
    wrong = evaluate_episodes(engine, ctok, examples, lambda: ToolEnvironment(Toolbox([calculator_off_by_one], isolation="inline")), **kw)
    assert wrong["pass@1"] == 0.0 and wrong["tool_use"] == 1.0

    class Mute(ToolEnvironment):    # runs the tools but gives the model nothing back
        def step(self, text):
            messages, reward, done = super().step(text)
            return [dict(m, role="user", content="ok") for m in messages], reward, done
    mute = evaluate_episodes(engine, ctok, examples, lambda: Mute(Toolbox([calculator], isolation="inline")), **kw)
    assert mute["pass@1"] == 0.0


def test_held_out_metrics_plays_episodes_only_with_an_environment(tok):
    from maxpost.evaluate import EvalConfig, held_out_metrics
    from maxpost.config import default_base
    problems = [p for p in tasks.generate_problems(12, seed=3, split="test") if " = " in p["answer"]][:2]
    examples = [dict(p, answer=gsm8k_gold(p["answer"])) for p in problems]
    engine, ctok = _tool_reader(problems)
    cfg = load_config(EvalConfig, ["base_output_directory=/tmp/x", "eval_k=0", "max_prompt_length=96",
                                   "environment=calculator", "max_turn_tokens=48", "max_episode_tokens=256"],
                      base=default_base("eval"))
    res = held_out_metrics(cfg, engine, ctok, examples)
    assert res["pass@1"] == 1.0 and res["tool_use"] == 1.0
    import dataclasses
    single = dataclasses.replace(cfg, environment="", max_completion_length=4)
    from maxpost.model import create_model, get_model_config
    model = create_model(get_model_config("tiny", num_layers=1), seed=0)
    out = held_out_metrics(single, model, tok, examples)
    assert "tool_use" not in out and out["mean_completion_length"] <= 4


def test_evaluation_through_a_runs_sampling_program_gives_the_same_greedy_completions(tok):
    """issue 47 item 3: an RL run evaluates through its one sampling program (as many rows as its rollout batch,
    prompts prefilled a block at a time, every prompt padded to at least the run's bucket): the padding is masked, so
    the greedy completions, pass@1, format rate and lengths are those of an evaluation without it, while its greedy
    pass and its k samples all run that one program."""
    from flax import nnx
    from maxpost.model import get_model_config, create_model
    model = create_model(get_model_config("tiny", num_layers=1, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                          mlp_dim=128), seed=1)
    examples = [dict(e, answer=gsm8k_gold(e["answer"])) for e in tasks.generate_problems(10, seed=0, split="test")]
    kw = dict(k=2, max_prompt_length=256, max_completion_length=8, return_completions=True)
    program = sampling.SamplingProgram(nnx.graphdef(model), rows=8, block=2, max_completion_length=8, min_bucket=256)
    before, shared = evaluate(model, tok, examples, **kw), evaluate(model, tok, examples, program=program, **kw)
    assert [c["completion"] for c in shared["completions"]] == [c["completion"] for c in before["completions"]]
    for key in ("pass@1", "format_rate", "mean_completion_length", "truncation_rate", "num_prompts"):
        assert shared[key] == before[key], key
    assert max(len(p) for p in prompt_token_ids(tok, [e["question"] for e in examples])) <= 128   # 256: padding only
    assert program.fn._cache_size() == 1                    # greedy over 8 prompts a call, 2 samples of 4: one program
