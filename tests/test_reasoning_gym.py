"""reasoning-gym tasks as maxpost datasets (chapter 03d): held-out splits that cannot leak (GSM-Symbolic by template,
other tasks by seed with no question in both splits), determinism, the score_answer reward against reasoning-gym's
own scorer, and the error when the package is missing."""
import json, sys
import pytest

rg = pytest.importorskip("reasoning_gym")
from maxpost.config import ConfigError
from maxpost.data import load_dataset_split
from maxpost.rewards import compute_rewards, correctness_reward
from maxpost.reasoning_gym import load_reasoning_gym, import_reasoning_gym
from maxpost.rewards import score_answer_reward


def templates_drawn(seed_offset: int, n: int) -> list[int]:
    "The GSM-Symbolic templates reasoning-gym itself draws (its generator index), independently of maxpost."
    return list(rg.create_dataset("gsm_symbolic", seed=seed_offset, size=n).task_indices)


def test_gsm_symbolic_templates_never_in_both_splits():
    train = load_dataset_split("reasoning_gym:gsm_symbolic", "train[:600]")
    test = load_dataset_split("reasoning_gym:gsm_symbolic", "test[:200]")
    tr, te = set(train["template_id"]), set(test["template_id"])
    assert not tr & te, f"templates in both splits: {sorted(tr & te)}"
    assert len(tr) >= 60 and len(te) >= 15          # the split holds most templates, not a handful
    # each row's template id is the generator reasoning-gym drew for that question: regenerate it from its entry
    ds = rg.create_dataset("gsm_symbolic", seed=0, size=2000)
    by_question = {ds[i]["question"]: int(ds.task_indices[i]) for i in range(2000)}
    assert all(by_question[q] == t for q, t in zip(train["question"], train["template_id"]) if q in by_question)
    assert sum(q in by_question for q in train["question"]) >= 500


@pytest.mark.parametrize("task,config", [("chain_sum", "min_terms=2,max_terms=2,min_digits=1,max_digits=2,test_size=300"),
                                         ("leg_counting", "test_size=300"), ("basic_arithmetic", "test_size=300")])
def test_no_question_in_both_splits_nor_twice(task, config):
    train = load_dataset_split(f"reasoning_gym:{task}", "train[:1000]", dataset_config=config)
    test = load_dataset_split(f"reasoning_gym:{task}", "test", dataset_config=config)
    assert len(test) == 300 and len(train) == 1000
    assert not set(train["question"]) & set(test["question"])
    assert len(set(train["question"])) == len(train) and len(set(test["question"])) == len(test)


def test_chain_sum_with_few_questions_still_does_not_leak():
    # 2 one-digit terms: at most a few hundred distinct questions, so the seeds alone would repeat many of them
    cfg = "min_terms=2,max_terms=2,min_digits=1,max_digits=1,test_size=60"
    test = set(load_reasoning_gym("chain_sum", "test", cfg)["question"])
    train = load_reasoning_gym("chain_sum", "train[:100]", cfg)["question"]
    assert not test & set(train)
    raw = rg.create_dataset("chain_sum", seed=0, size=100, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len({raw[i]["question"] for i in range(100)} & test) > 0      # what reasoning-gym alone would leak


def test_deterministic_per_seed():
    a = load_reasoning_gym("gsm_symbolic", "train[:50]", "seed=2")
    assert a.to_list() == load_reasoning_gym("gsm_symbolic", "train[:50]", "seed=2").to_list()
    assert a["question"] != load_reasoning_gym("gsm_symbolic", "train[:50]", "seed=3")["question"]
    # a slice is the same rows as the prefix of a larger request
    assert load_reasoning_gym("gsm_symbolic", "train[20:50]", "seed=2")["question"] == a["question"][20:]


def test_rows_have_the_columns_rl_and_sft_read():
    row = load_reasoning_gym("gsm_symbolic", "test[:1]")[0]
    entry = json.loads(row["rg_entry"])
    assert row["answer"].rsplit("####", 1)[1].strip() == entry["answer"]      # GSM8K-format worked answer
    assert row["messages"][-1] == {"role": "assistant", "content": row["answer"]}
    assert correctness_reward([""], [f"so the answer is {entry['answer']}."], answer=[row["answer"]]) == [1.0]


REPLIES = ["Let me add them. {g}", "The answer is {g}.", "**Answer:** {g}", r"Therefore $\boxed{{{g}}}$", "#### {g}",
           "The answer is {w}.", "I get {w}", "no number here", ""]

@pytest.mark.parametrize("task", ["gsm_symbolic", "chain_sum", "leg_counting", "basic_arithmetic"])
def test_score_answer_reward_agrees_with_reasoning_gym(task):
    rows = load_reasoning_gym(task, "test[:3]", "test_size=50")
    for row in rows:
        entry = json.loads(row["rg_entry"])
        gold, scorer = entry["answer"], rg.get_score_answer_fn(task)
        wrong = str(int(float(gold)) + 7)
        replies = [r.format(g=gold, w=wrong) for r in REPLIES]
        # reasoning-gym's scorer given the answer each reply states (written out here, not extracted by maxpost)
        stated = [gold] * 5 + [wrong] * 2 + [None, None]
        expected = [scorer(s, entry) for s in stated]
        assert expected[:5] == [1.0] * 5 and all(e < 1 for e in expected[5:])
        assert score_answer_reward(None, replies, [row["rg_entry"]] * len(replies)) == expected


def test_score_answer_reward_through_compute_rewards():
    row = load_reasoning_gym("gsm_symbolic", "test[:1]")[0]
    gold = json.loads(row["rg_entry"])["answer"]
    total, per, _ = compute_rewards(["maxpost.rewards:score_answer_reward"], ["q", "q"],
                                    [f"The answer is {gold}.", "The answer is 0.5."],
                                    {"rg_entry": [row["rg_entry"]] * 2, "answer": [row["answer"]] * 2}, isolation="thread")
    assert per["score_answer_reward"].tolist() == [1.0, pytest.approx(0.01)]


def test_errors_name_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match="has no split 'validation'"): load_reasoning_gym("chain_sum", "validation")
    with pytest.raises(ConfigError, match="has no task"): load_dataset_split("reasoning_gym:no_such_task", "train[:2]")
    with pytest.raises(ConfigError, match="its options"): load_reasoning_gym("chain_sum", "train[:2]", "bogus_option=1")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)          # as if not installed
    with pytest.raises(ConfigError, match=r'pip install "maxpost\[reasoning-gym\]"'):
        load_dataset_split("reasoning_gym:gsm_symbolic", "train[:2]")
    with pytest.raises(ConfigError, match=r'pip install "maxpost\[reasoning-gym\]"'): import_reasoning_gym()
