"""bench/reward_rl.py's data and bookkeeping: the probe's wrong worked solution is wrong and self-consistent, the
correctness pairs always choose the right answer and never let form predict the choice, and the summary's mean and
spread are NumPy's over the seeds."""
import json, random, re, sys
from pathlib import Path

import numpy as np

from maxpost.tasks import Difficulty, make_splits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import reward_rl  # noqa: E402

STEP = re.compile(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def final(reply: str) -> int: return int(re.search(r"<answer>(-?\d+)</answer>", reply)[1])


def steps_hold(reply: str) -> list[bool]: return [OPS[o](int(a), int(b)) == int(c) for a, o, b, c in STEP.findall(reply)]


def test_wrong_last_step_is_wrong_and_consistent():
    rows, _ = make_splits(seed=0, n_train=200, n_test=1, difficulty=Difficulty())
    rng = random.Random(0)
    for r in rows:
        right = int(r["answer"].rsplit("####", 1)[1])
        rep = reward_rl.replies(r["answer"], rng)
        wrong = rep["worked_wrong"]
        assert final(wrong) != right and 1 <= abs(final(wrong) - right) <= 3 and final(wrong) >= 0
        assert steps_hold(wrong)[:-1] == [True] * (len(steps_hold(wrong)) - 1) and not steps_hold(wrong)[-1]
        assert int(STEP.findall(wrong)[-1][3]) == final(wrong)        # the reasoning leads to the wrong answer
        assert all(steps_hold(rep["worked"])) and final(rep["worked"]) == final(rep["answer_only"]) == right
        assert final(rep["worked_slip"]) == final(rep["answer_only_slip"]) != right


def test_correct_pairs_choose_the_right_answer_and_form_predicts_nothing(tmp_path):
    rows, test = make_splits(seed=0, n_train=2000, n_test=10, difficulty=Difficulty())
    (tmp_path / "embedded_task").mkdir()
    for split, rs in (("train", rows), ("test", test)):
        (tmp_path / "embedded_task" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    out = reward_rl.correct_pairs(tmp_path)
    pairs = [json.loads(l) for l in open(out / "train.jsonl")]
    worked = lambda m: not re.match(r"<reasoning></reasoning>", m[0]["content"])
    for p, r in zip(pairs, rows):
        right = int(r["answer"].rsplit("####", 1)[1])
        assert final(p["chosen"][0]["content"]) == right != final(p["rejected"][0]["content"])
        assert p["prompt"][-1]["content"] == r["question"]
    chosen_worked = np.mean([worked(p["chosen"]) for p in pairs])
    rejected_worked = np.mean([worked(p["rejected"]) for p in pairs])
    assert abs(chosen_worked - 0.6) < 0.04 and abs(rejected_worked - 0.6) < 0.04


def test_summary_is_numpys_mean_and_sample_sd():
    per_seed = {str(s): {"pass@1_before": 14.8, "pass@1_after": a, "exit_code": 0, "wall_min": 1.0}
                for s, a in enumerate([57.8, 56.2, 50.8])}
    got = reward_rl.summary(per_seed)
    after = np.array([57.8, 56.2, 50.8])
    assert got["pass@1_after"] == round(after.mean(), 1) and got["pass@1_after_sd"] == round(after.std(ddof=1), 1)
    assert got["gain_mean"] == round(after.mean() - 14.8, 1) and got["gain_over_2sd"] is True
    per_seed["1"]["exit_code"] = 3
    assert reward_rl.summary(per_seed)["exit_code"] == 3
