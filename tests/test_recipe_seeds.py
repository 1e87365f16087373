"""bench/recipe_seeds.py's bookkeeping on planted runs: the record's own seed 0 is kept, new seeds land beside it, and
the mean and spread are NumPy's over seeds 0-2 (not the rerun of seed 0)."""
import json, sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import recipe_seeds  # noqa: E402


def plant_run(base: Path, name: str, before: float, after: float, wall_s: float, rc: int = 0):
    (base / f"{name}.json").write_text(json.dumps({"command": "maxpost rl", "started": "t", "exit_code": rc,
                                                   "wall_s": wall_s, "load_average_start": [4.123, 4.0, 4.0],
                                                   "load_average_end": [4.0, 4.0, 4.0]}))
    (base / f"{name}.log").write_text(f"noise\nrl embedded-{name}: step 60/60 eval pass@1={after / 100:.4f}\n"
                                      f"held-out (128 problems): step 0 -> step 60\n"
                                      f"  pass@1        {before:.1f} % ->  {after:.1f} %\n  pass@4  1 % -> 2 %\n")


def test_record_keeps_seed_0_and_takes_numpys_mean_and_sample_sd(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    seed0 = {"command": "maxpost rl loss_algo=cispo", "exit_code": 0, "wall_s": 1485.9, "wall_min": 24.8,
             "pass@1_before": 14.8, "pass@1_after": 61.7, "printed": ["  pass@1        14.8 % ->  61.7 %"]}
    (root / "bench" / "results" / "rl_recipes.json").write_text(json.dumps({"about": "a", "commands": {"cispo": seed0}}))
    monkeypatch.setattr(recipe_seeds, "ROOT", root)
    monkeypatch.setattr(recipe_seeds, "RECIPES", {"cispo": ("rl_recipes.json", ["rl", "loss_algo=cispo"])})
    runs = tmp_path / "runs"; runs.mkdir()
    plant_run(runs, "cispo-s1", 14.8, 69.5, 150.0)
    plant_run(runs, "cispo-s2", 14.8, 68.0, 130.0)
    plant_run(runs, "cispo-s0", 14.8, 99.0, 140.0)       # the rerun: beside seed 0, not in place of it
    recipe_seeds.record(runs)
    recipe_seeds.record(runs)                             # twice: the same record
    entry = json.loads((root / "bench" / "results" / "rl_recipes.json").read_text())["commands"]["cispo"]
    assert entry["pass@1_after"] == 61.7 and entry["wall_min"] == 24.8          # seed 0's own fields stand
    assert entry["per_seed"]["0"]["pass@1_after"] == 61.7 and entry["per_seed"]["0_rerun"]["pass@1_after"] == 99.0
    assert entry["per_seed"]["1"]["load_average_start"][0] == 4.12
    m, after = entry["mean"], np.array([61.7, 69.5, 68.0])
    assert m["seeds"] == [0, 1, 2] and m["pass@1_after_per_seed"] == after.tolist()
    assert abs(m["pass@1_after"] - after.mean()) < 0.05 and abs(m["pass@1_after_sd"] - after.std(ddof=1)) < 0.05
    assert abs(m["gain_mean"] - (after - 14.8).mean()) < 0.05 and m["gain_over_2sd"] is True
    assert m["pass@1_before"] == 14.8 and m["exit_code"] == 0
    assert abs(m["wall_min"] - np.mean([150, 130, 140]) / 60) < 0.05            # today's runs only


def test_a_failed_seed_fails_the_mean(tmp_path, monkeypatch):
    root = tmp_path / "repo"; (root / "bench" / "results").mkdir(parents=True)
    monkeypatch.setattr(recipe_seeds, "ROOT", root)
    monkeypatch.setattr(recipe_seeds, "RECIPES", {"grpo": ("base.json", ["rl"])})
    runs = tmp_path / "runs"; runs.mkdir()
    for s, rc in ((0, 0), (1, 1), (2, 0)): plant_run(runs, f"grpo-s{s}", 14.8, 60.0 + s, 100.0, rc)
    recipe_seeds.record(runs)
    m = json.loads((root / "bench" / "results" / "base.json").read_text())["commands"]["grpo"]["mean"]
    assert m["exit_code"] == 1 and m["seeds"] == [0, 1, 2]


def test_rollout_totals_sum_every_logged_step(tmp_path):
    """What a run sampled, from its metrics.jsonl: a dynamic-sampling step counts its rounds, dropped groups and empty
    slots; a plain GRPO step one round and frac_reward_zero_std of its groups; a run not logged at every step none."""
    run = tmp_path / "r"; run.mkdir()
    (run / "config.yml").write_text("global_batch_size: 16\nnum_generations: 4\nsteps: 2\n")
    recs = [{"step": 0, "kind": "eval"},
            {"step": 1, "kind": "train", "completions/mean_length": 10.0, "dynamic_sampling/rounds": 3,
             "dynamic_sampling/groups_dropped": 5, "dynamic_sampling/filled_fraction": 0.75, "frac_reward_zero_std": 0.4},
            {"step": 2, "kind": "train", "completions/mean_length": 20.0, "frac_reward_zero_std": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = recipe_seeds.rollout_totals(run)
    assert t == {"steps": 2, "rollout_rounds": 4, "completions_sampled": 64, "completion_tokens_sampled": 3 * 16 * 10 + 16 * 20,
                 "zero_spread_groups": 5 + 2, "groups_trained": 8, "empty_slots": 1}, t
    (run / "config.yml").write_text("global_batch_size: 16\nnum_generations: 4\nsteps: 3\n")
    assert recipe_seeds.rollout_totals(run) == {} and recipe_seeds.rollout_totals(tmp_path / "none") == {}
