"""The embedded task: determinism, disjoint splits, arithmetic that checks out, knobs, files, and the tokenizer."""
import json, os, re, subprocess, sys
from collections import Counter

import pytest

from maxpost.tasks import (Difficulty, HASTY_ERROR_RATE, SHORTCUT_SHARE, SYSTEM_PROMPT, TAGS, build_tokenizer, format_completion, generate_problems,
                           is_answer_only, make_splits, prepare_embedded, prompt_messages, sft_messages, skip_last_step,
                           write_embedded_task)

_EQ = re.compile(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)")

def redo(problem):
    """Recompute a problem from its text alone: (question numbers, [(x, op, b, y)], final) with every check done."""
    q, a = problem["question"], problem["answer"]
    *lines, last = a.split("\n")
    assert re.fullmatch(r"#### \d+", last), last
    start = int(re.search(r"starts with (\d+)", lines[0])[1])
    steps, x = [], start
    for line in lines[1:]:
        (xs, op, bs, ys), = _EQ.findall(line)                      # exactly one equation per reasoning line
        xv, b, y = int(xs), int(bs), int(ys)
        assert xv == x, (line, x)                                   # each step starts from the previous result
        assert y == {"+": xv + b, "-": xv - b, "*": xv * b}[op], line
        steps.append((xv, op, b, y)); x = y
    assert int(last[5:]) == x
    q_numbers = [int(n) for n in re.findall(r"\d+", q)]
    assert q_numbers == [start] + [b for _, _, b, _ in steps], (q, steps)   # the question states exactly these numbers
    return steps, x

@pytest.fixture(scope="module")
def splits(): return make_splits(seed=0, n_train=3000, n_test=500)

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok"); return build_tokenizer(d), d

def test_default_knobs():
    """The embedded default chosen by the RL study of the tutorial: two steps on small numbers."""
    d = Difficulty()
    assert (d.min_steps, d.max_steps, d.max_operand, d.min_multiplier, d.max_multiplier, d.max_value, d.operations) == \
        (2, 2, 10, 2, 3, 50, ("+", "-", "*"))

def test_deterministic_across_processes(splits):
    code = ("import json; from maxpost.tasks import make_splits; "
            "print(json.dumps(make_splits(seed=0, n_train=3000, n_test=500)))")
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out) == [list(splits[0]), list(splits[1])]
    assert generate_problems(50, seed=1) != generate_problems(50, seed=0)
    assert generate_problems(50, seed=0, split="a") != generate_problems(50, seed=0, split="b")

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_splits_disjoint_and_distinct(seed):
    train, test = make_splits(seed=seed, n_train=4000, n_test=800)
    tq, sq = [p["question"] for p in train], [p["question"] for p in test]
    assert len(set(tq)) == len(tq) == 4000 and len(set(sq)) == len(sq) == 800
    assert not set(tq) & set(sq)
    assert make_splits(seed=seed, n_train=10, n_test=800)[1] == test     # the test set does not move with n_train

def test_answers_are_the_arithmetic(splits):
    for p in splits[0] + splits[1]:
        steps, final = redo(p)
        assert len(steps) == 2 and all(0 <= y <= 50 for *_, y in steps)

@pytest.mark.parametrize("knobs", [
    dict(min_steps=1, max_steps=1, operations=("+",)),
    dict(min_steps=2, max_steps=2, operations=("-", "*"), max_operand=9),
    dict(min_steps=4, max_steps=6, max_operand=50, min_multiplier=3, max_multiplier=3, max_value=500),
    dict(min_steps=3, max_steps=3, operations=("*",), max_operand=5, max_value=1000, max_multiplier=4),
])
def test_difficulty_knobs(knobs):
    d = Difficulty(**knobs)
    problems = generate_problems(400, seed=3, difficulty=d)
    counts, ops = Counter(), Counter()
    for p in problems:
        steps, _ = redo(p)
        counts[len(steps)] += 1
        assert 1 <= steps[0][0] <= d.max_operand                       # the starting number
        for x, op, b, y in steps:
            ops[op] += 1
            assert op in d.operations and 0 <= y <= d.max_value
            if op == "*": assert d.min_multiplier <= b <= d.max_multiplier
            else: assert 1 <= b <= d.max_operand
    assert set(counts) == set(range(d.min_steps, d.max_steps + 1))       # every step count occurs, no other
    assert set(ops) == set(d.operations)

def test_bad_knobs():
    with pytest.raises(ValueError): Difficulty(operations=("/",))
    with pytest.raises(ValueError): Difficulty(min_multiplier=1)
    with pytest.raises(ValueError, match="distinct"):
        generate_problems(1000, difficulty=Difficulty(min_steps=1, max_steps=1, max_operand=1, operations=("*",)))

def test_prompt_and_completion(splits):
    p = splits[1][0]
    msgs = sft_messages(p)
    assert msgs[:2] == prompt_messages(p["question"]) == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p["question"]}]
    c = msgs[2]["content"]
    m = re.fullmatch(r"<reasoning>(.*)</reasoning><answer>(\d+)</answer>", c, re.S)
    assert m and m[1] == p["answer"].split("\n####")[0] and m[2] == p["answer"].split("#### ")[1]
    assert all(t in SYSTEM_PROMPT for t in TAGS)
    assert sft_messages(p, system_prompt=None)[0]["role"] == "user"
    short = sft_messages(p, shortcut=True)                 # an answer-only demonstration: same prompt, empty reasoning
    assert short[:2] == msgs[:2] and short[2]["content"] == f"<reasoning></reasoning><answer>{m[2]}</answer>"

def test_files_load_with_datasets(tmp_path):
    import datasets
    paths = write_embedded_task(tmp_path, seed=4, n_train=300, n_test=40, max_steps=2)
    assert set(paths) == {"train", "test", "sft_train", "sft_test"}
    ds = datasets.load_dataset("json", data_files={"train": paths["train"], "test": paths["test"]}, cache_dir=str(tmp_path / "c"))
    train, test = make_splits(seed=4, n_train=300, n_test=40, difficulty=Difficulty(max_steps=2))
    assert ds["train"].to_list() == train and ds["test"].to_list() == test
    sft = datasets.load_dataset("json", data_files={"train": paths["sft_train"], "test": paths["sft_test"]}, cache_dir=str(tmp_path / "c"))
    assert sft["test"].column_names == ["messages"]
    kinds = {"worked": 0, "answer-only": 0, "slip": 0}
    for split, rows in (("train", train), ("test", test)):
        for got, p in zip((r["messages"] for r in sft[split]), rows, strict=True):
            options = {"worked": sft_messages(p), "answer-only": sft_messages(p, shortcut=True),
                       "slip": sft_messages({**p, "answer": skip_last_step(p["answer"])}, shortcut=True)}
            kind = [k for k, m in options.items() if got == m]
            assert kind, got                                # a worked, an answer-only or a slipped demonstration
            kinds[kind[0]] += 1
    # binomial sd at n=340 is at most 0.027: the shares are the knobs' within 0.1
    assert abs((kinds["answer-only"] + kinds["slip"]) / 340 - SHORTCUT_SHARE) < 0.1
    assert abs(kinds["slip"] / 340 - SHORTCUT_SHARE * HASTY_ERROR_RATE) < 0.1
    for share, want in ((0.0, False), (1.0, True)):
        d = write_embedded_task(tmp_path / f"s{share}", seed=4, n_train=30, n_test=5, shortcut_share=share)
        rows = [json.loads(l)["messages"][-1]["content"] for l in open(d["sft_train"])]
        assert all(is_answer_only(r) == want for r in rows)
    d = write_embedded_task(tmp_path / "noslip", seed=4, n_train=30, n_test=5, shortcut_share=1.0, hasty_error_rate=0.0)
    sft_rows = [json.loads(l)["messages"] for l in open(d["sft_train"])]
    train = [json.loads(l) for l in open(d["train"])]
    assert sft_rows == [sft_messages(p, shortcut=True) for p in train]     # no slips: every answer is right
    with pytest.raises(ValueError, match="shortcut_share"): write_embedded_task(tmp_path / "bad", shortcut_share=1.5)
    with pytest.raises(ValueError, match="hasty_error_rate"): write_embedded_task(tmp_path / "bad", hasty_error_rate=-0.1)

def _values_from_question(question: str) -> tuple[int, list[int]]:
    "The start value and the running value after each step, recomputed from the question's sentences alone."
    sentences = question.split(". ")
    x0 = x = int(re.findall(r"\d+", sentences[0])[0])
    values = []
    for s in sentences[1:-1]:                       # one sentence a step; the last one asks the question
        b = int(re.findall(r"\d+", s)[0])
        x = x * b if "times as many" in s else x + b if " more " in s else x - b
        values.append(x)
    return x0, values

@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_skip_last_step_is_the_value_before_the_last_step(steps):
    train, _ = make_splits(seed=steps, n_train=200, n_test=4, difficulty=Difficulty(min_steps=steps, max_steps=steps))
    for p in train:
        x0, values = _values_from_question(p["question"])
        assert len(values) == steps and p["answer"].rsplit("####", 1)[1].strip() == str(values[-1]), p
        before = values[-2] if steps > 1 else x0
        assert skip_last_step(p["answer"]).rsplit("####", 1)[1].strip() == str(before), p["question"]

def test_tokenizer_round_trip_and_size(tok, splits):
    tokenizer, _ = tok
    assert len(tokenizer) <= 512
    texts = []
    for p in splits[0][:1500] + splits[1]:
        texts += [p["question"], p["answer"], format_completion(p["answer"]),
                  tokenizer.apply_chat_template(sft_messages(p), tokenize=False)]
    texts += ["An unseen word: photosynthesis!", "Caf\u00e9 \u2615 \u4e2d\u6587", "tabs\tand\r\nnewlines", "  two  spaces  "]
    for t in texts:
        ids = tokenizer.encode(t, add_special_tokens=False)
        assert tokenizer.unk_token_id not in ids, t
        assert tokenizer.decode(ids) == t

def test_tokenizer_pieces(tok):
    tokenizer, _ = tok
    vocab = tokenizer.get_vocab()
    for d in "0123456789": assert d in vocab
    assert not [t for t in vocab if re.search(r"\d", t) and len(t) > 1 and not t.startswith("<0x")]   # digits never merged
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]
    for word in ["Mia", " apples", " gives", " How", " many", " starts"]: assert word in vocab        # template words whole
    assert tokenizer.tokenize("Mia has 12 apples.") == ["Mia", " has", " ", "1", "2", " apples", "."]
    for t in TAGS:                                                     # tags: single, not special
        assert tokenizer.tokenize(t) == [t] and t not in tokenizer.all_special_tokens
    assert tokenizer.decode(tokenizer.encode("<answer>7</answer><|im_end|>"), skip_special_tokens=True) == "<answer>7</answer>"
    assert len(tokenizer.tokenize("photosynthesis")) > 1               # an unknown word falls back to pieces

def test_chat_template_and_auto_tokenizer(tok, splits):
    from transformers import AutoTokenizer
    tokenizer, d = tok
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert "{% generation %}" in config["chat_template"]
    auto = AutoTokenizer.from_pretrained(d)
    assert (auto.pad_token, auto.eos_token, auto.pad_token_id) == ("<|pad|>", "<|im_end|>", 0)
    p = splits[1][0]
    msgs = sft_messages(p)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    assert auto.apply_chat_template(msgs, tokenize=False) == expected
    gen = auto.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen == expected.rsplit("<|im_start|>assistant", 1)[0] + "<|im_start|>assistant\n"
    enc = auto.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    assert enc["input_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    marked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert auto.decode(marked) == msgs[2]["content"] + "<|im_end|>"

def test_prepare_embedded_is_idempotent(tmp_path):
    paths = prepare_embedded(tmp_path, n_train=200, n_test=30)
    stamps = {k: os.stat(v).st_mtime_ns for k, v in paths.items() if k != "tokenizer"}
    stamps["tok"] = os.stat(tmp_path / "tokenizer.json").st_mtime_ns
    assert prepare_embedded(tmp_path, n_train=200, n_test=30) == paths
    assert stamps == {**{k: os.stat(v).st_mtime_ns for k, v in paths.items() if k != "tokenizer"},
                      "tok": os.stat(tmp_path / "tokenizer.json").st_mtime_ns}
    prepare_embedded(tmp_path, n_train=200, n_test=30, min_steps=1, max_steps=1)         # a different request rewrites
    assert all(len(redo(json.loads(l))[0]) == 1 for l in open(paths["train"]))
    os.remove(paths["sft_test"])                                              # a missing file is rewritten
    prepare_embedded(tmp_path, n_train=200, n_test=30, min_steps=1, max_steps=1)
    assert sum(1 for _ in open(paths["sft_test"])) == 30


def test_a_runs_seed_does_not_rewrite_the_embedded_task(tmp_path, monkeypatch):
    "`seed=` re-seeds a run, not its data: the embedded task is written from TASK_SEED, so a run at seed 3 neither rebuilds the task other runs of the directory use nor draws held-out problems that an SFT checkpoint made at seed 0 trained on."
    import maxpost.tasks as t
    from maxpost.config import TrainConfig, load_config
    asked = []
    monkeypatch.setattr(t, "prepare_task", lambda d, v, seed: asked.append(seed) or {})
    for seed in (0, 3):
        t.prepare_embedded_task(load_config(TrainConfig, ["run_name=x", f"base_output_directory={tmp_path}", f"seed={seed}"]))
    assert asked == [t.TASK_SEED, t.TASK_SEED] == [0, 0]


def test_the_embedded_task_written_by_a_child_process_is_the_one_written_here(tmp_path):
    """issue 47 item 6: a command starts the embedded task's writer as a child process (`start_embedded_task`) while
    the runtime starts; the files it writes are those `prepare_task` writes in this process, and a second start
    finds them written."""
    from maxpost.config import RunConfig
    from maxpost.tasks import prepare_embedded_task, prepare_task, start_embedded_task
    cfg = RunConfig(base_output_directory=str(tmp_path / "child"))
    child = start_embedded_task(cfg)
    assert child is not None and child.wait() == 0
    assert start_embedded_task(cfg) is None
    here = prepare_task(tmp_path / "here")
    for name, path in prepare_embedded_task(cfg).items():
        if name != "tokenizer": assert open(path, "rb").read() == open(here[name], "rb").read(), name
    for f in ("tokenizer.json", "tokenizer_config.json", "embedded.json"):
        assert (tmp_path / "child" / "embedded_task" / f).read_bytes() == (tmp_path / "here" / f).read_bytes(), f


def test_a_child_that_cannot_write_the_task_leaves_the_one_line_error_to_the_command(tmp_path):
    "A child that fails (here: its directory's parent is a file) writes no manifest; the command's own write says why."
    from maxpost.config import ConfigError, RunConfig
    from maxpost.tasks import prepare_embedded_task, start_embedded_task
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = RunConfig(base_output_directory=str(blocker))
    child = start_embedded_task(cfg)
    assert child is not None and child.wait() != 0
    with pytest.raises(ConfigError, match="could not write the embedded task"): prepare_embedded_task(cfg)


def test_the_embedded_tasks_arrow_copies_stay_in_its_directory_not_in_the_users_cache(tmp_path, monkeypatch):
    """datasets keeps an arrow copy of every local file it reads, by default in the user's cache under a key that
    follows the file's path: the embedded task, written anew under each base_output_directory, left 13 MB there per
    directory (21 GB on the test host in a day). Its copies now go to its own `.datasets_cache`."""
    import datasets
    from maxpost.config import load_config
    from maxpost.data import DATASETS_CACHE, load_dataset_split
    from maxpost.tasks import embedded_split, embedded_task_dir
    home = tmp_path / "users-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home)
    cfg = load_config("sft", [f"base_output_directory={tmp_path / 'runs'}"])
    assert len(load_dataset_split(*embedded_split(cfg, "train[:16]", "sft_"))) == 16
    assert not list(home.rglob("*.arrow"))
    assert list((embedded_task_dir(cfg) / DATASETS_CACHE).rglob("*.arrow"))
