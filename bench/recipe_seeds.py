"""More seeds for the embedded task's RL recipes (CISPO, RLOO; issue 50) and KTO (issue 51), from the main job's default
`maxpost sft` checkpoint (the README's 14.8 % one).

    python bench/recipe_seeds.py run BASE cispo 1 [cispo 2 rloo 1 ...]   # each run to the end, one after the other
    python bench/recipe_seeds.py record BASE                             # the finished runs into the records

When these seeds ran, `seed=S` seeded the run's data order and sampling, but also the embedded task itself (since
fixed: the task is now always written from `maxpost.tasks.TASK_SEED`, so the per-seed directories below only keep
the runs reproducible as they were made): with `dataset_name=""`,
`maxpost` (re)writes `base_output_directory/embedded_task` from seed S unless that directory's `embedded.json` names
seed S, so `maxpost rl seed=1` from the seed-0 SFT checkpoint would train and evaluate on other problems than seed 0
did (31 of seed 1's 1000 held-out problems, 5 of the 128 evaluated, are in seed 0's training set that the SFT saw).
To vary only the run's randomness, `run` gives each seed its own base directory BASE/sS holding the seed-0 task's
files (copied from TASK, the main job's `embedded_task`) under a manifest that names seed S, so the run reads them
as they are. It calls `maxpost <command> seed=S run_name=embedded-<recipe>-s<S> base_output_directory=BASE/sS
load_parameters_path=BASE/embedded-sft` (BASE holds a copy of the SFT run directory), logs its output to
BASE/<recipe>-s<S>.log and writes BASE/<recipe>-s<S>.json (wall time, exit code, load average at start and end).
`record` reads those, adds each seed beside seed 0 in bench/results/rl_recipes.json / kto_embedded.json (per_seed),
and writes `mean`: over seeds 0, 1, 2 the mean and the sample standard deviation of pass@1 after and of the gain."""
import json, os, re, shutil, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = Path(os.environ.get("TASK", "maxpost_runs/embedded_task"))   # the main job's seed-0 task, which the SFT saw
RECIPES = {                           # recipe: (record file, the command's keys, as the seed-0 record gives them)
    "cispo": ("rl_recipes.json", ["rl", "loss_algo=cispo"]),
    "rloo": ("rl_recipes.json", ["rl", "advantage_estimator=rloo"]),
    "ppo": ("rl_recipes.json", ["rl", "advantage_estimator=gae"]),   # PPO with a critic (chapter 15f_ppo), seeds 0-2 all by `run`
    "kto": ("kto_embedded.json", ["dpo", "loss_type=kto"]),
    "dapo_ds": ("rl_recipes.json", ["rl", "dynamic_sampling=true", "log_period=1"]),   # every step's dynamic_sampling/*
    "grpo_logged": ("rl_recipes.json", ["rl", "log_period=1"]),   # GRPO beside dapo_ds: same host, every step logged
    "grpo": ("recipe_seeds_baselines.json", ["rl"]),     # the baselines, the same way: the main job's GRPO and DPO
    "dpo": ("recipe_seeds_baselines.json", ["dpo"]),
}
BASELINES_ABOUT = ("The README's GRPO (`maxpost rl`) and DPO (`maxpost dpo`) on the embedded task, seeds 0, 1 and 2, "
                   "each from the main job's default `maxpost sft` checkpoint (the README's 14.8 % one), run by "
                   "bench/recipe_seeds.py beside its CISPO, RLOO and KTO seeds (same task files, same host): the "
                   "baselines for bench/results/rl_recipes.json and kto_embedded.json. Held-out greedy pass@1 in % "
                   "of 128 problems.")
SEEDS_ABOUT = ("Seeds 1 and 2 (per_seed, and `mean` over seeds 0-2) were added by bench/recipe_seeds.py on 2026-12-06, "
               "`seed=S` from the same SFT checkpoint with the seed-0 task's files kept (see the script), one run at "
               "a time under nice -n 15 at a load average about 4 on the 2-core CPU, so their wall times are not "
               "comparable with seed 0's above; per_seed['0_rerun'] is seed 0 again on the same code and host (its "
               "greedy pass@1, rewards and kl equal the record's seed 0; its sampled pass@4/maj@4 do not). "
               "CISPO's seed 1 shared its first minute with an aborted run.")
KEEP = re.compile(r"^(?:rl|dpo) embedded-\S+: step \d+/\d+ eval pass@1=|^step=\d+ .*pass@1=|^  pass@1 ")


def run(base: Path, recipe: str, seed: int):
    name, sdir = f"{recipe}-s{seed}", base / f"s{seed}"
    task = sdir / "embedded_task"
    if not task.exists():
        shutil.copytree(TASK, task)
        manifest = json.loads((TASK / "embedded.json").read_text())
        assert manifest["seed"] == 0, manifest
        (task / "embedded.json").write_text(json.dumps(manifest | {"seed": seed}, indent=1))
    args = RECIPES[recipe][1] + [f"seed={seed}", f"run_name=embedded-{name}", f"base_output_directory={sdir}",
                                 f"load_parameters_path={base}/embedded-sft"]
    exe = Path(sys.executable).parent / "maxpost"
    info = {"command": "maxpost " + " ".join(args), "load_average_start": list(os.getloadavg()), "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.time()
    with open(base / f"{name}.log", "w") as log:
        rc = subprocess.call([str(exe), *args], stdout=log, stderr=subprocess.STDOUT)
    info.update(exit_code=rc, wall_s=round(time.time() - t0, 1), load_average_end=list(os.getloadavg()))
    (base / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
    print(name, "exit", rc, "wall", info["wall_s"], "s", flush=True)


def parse(log: Path) -> dict:
    printed = [l.rstrip("\n") for l in log.read_text().splitlines() if KEEP.search(l)]
    m = re.search(r"pass@1 +([\d.]+) % -> +([\d.]+) %", "\n".join(printed))
    return {"pass@1_before": float(m[1]), "pass@1_after": float(m[2]), "printed": printed} if m else {"printed": printed}


def rollout_totals(run: Path) -> dict:
    """What a run sampled and wasted, summed over its steps from metrics.jsonl (only when every step was logged,
    log_period=1): rollout rounds, completions and completion tokens sampled (rounds x global_batch_size x the
    sampled completions' mean length), groups of zero reward spread (dropped by dynamic sampling, or trained on with
    advantage 0 without it: frac_reward_zero_std of each step's groups) and group slots left empty."""
    import yaml
    if not (run / "metrics.jsonl").exists(): return {}
    cfg = yaml.safe_load((run / "config.yml").read_text())
    B, G, steps = cfg["global_batch_size"], cfg["num_generations"], cfg["steps"]
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in l]
    if len(recs) != steps: return {}
    rounds = [r.get("dynamic_sampling/rounds", 1) for r in recs]
    zero = [r["dynamic_sampling/groups_dropped"] if "dynamic_sampling/rounds" in r
            else round(r["frac_reward_zero_std"] * (B // G)) for r in recs]
    return {"steps": steps, "rollout_rounds": sum(rounds), "completions_sampled": sum(rounds) * B,
            "completion_tokens_sampled": round(sum(n * B * r["completions/mean_length"] for n, r in zip(rounds, recs))),
            "zero_spread_groups": sum(zero), "groups_trained": steps * B // G,
            "empty_slots": round(sum((1 - r.get("dynamic_sampling/filled_fraction", 1.0)) * (B // G) for r in recs))}


def summary(per_seed: dict, seeds: list[str], today: list[str]) -> dict:
    "Mean and sample standard deviation over `seeds` of pass@1 after and of the gain; the mean wall time of the runs in `today` (one host load)."
    after = [per_seed[s]["pass@1_after"] for s in seeds]
    gain = [per_seed[s]["pass@1_after"] - per_seed[s]["pass@1_before"] for s in seeds]
    before = {per_seed[s]["pass@1_before"] for s in seeds}
    sd = statistics.stdev(after) if len(after) > 1 else None
    return {"seeds": [int(s) for s in seeds], "n_seeds": len(seeds),
            "exit_code": max(per_seed[s]["exit_code"] for s in seeds),
            "pass@1_before": before.pop() if len(before) == 1 else None,
            "pass@1_after_per_seed": after, "pass@1_after": round(statistics.mean(after), 1),
            "pass@1_after_sd": None if sd is None else round(sd, 1),
            "gain_mean": round(statistics.mean(gain), 1),
            "gain_sd": None if sd is None else round(statistics.stdev(gain), 1),
            "gain_over_2sd": None if sd is None else statistics.mean(gain) > 2 * statistics.stdev(gain),
            "wall_min_per_seed": [round(per_seed[s]["wall_s"] / 60, 1) for s in seeds],
            "wall_min": round(statistics.mean(per_seed[s]["wall_s"] / 60 for s in today), 1) if today else None,
            "wall_min_of": "mean over the runs of " + ", ".join(
                               "seed 0 (rerun)" if s == "0_rerun" else f"seed {s}" for s in sorted(today))
                           + ": one host load, in the runs' per_seed load averages",
            **({"rollout_totals_mean": {k: round(statistics.mean(per_seed[s]["rollout_totals"][k] for s in seeds), 1)
                                        for k in per_seed[seeds[0]]["rollout_totals"]}}
               if all(per_seed[s].get("rollout_totals") for s in seeds) else {})}


def record(base: Path):
    """Each recipe's runs under `base` into its record: per_seed["0"] is the record's own seed-0 run as it stands,
    per_seed["1"], ["2"] and per_seed["0_rerun"] (seed 0 again, on this code, beside the others) come from `run`;
    `mean` is over seeds 0, 1, 2 (the record's seed 0)."""
    for recipe, (file, _) in RECIPES.items():
        path = ROOT / "bench" / "results" / file
        if not any(base.glob(f"{recipe}-s*.json")): continue
        rec = json.loads(path.read_text()) if path.exists() else {"about": BASELINES_ABOUT, "commands": {}}
        fresh = recipe not in rec["commands"]          # a baseline: its seed 0 is a run of `run` too
        entry = rec["commands"].setdefault(recipe, {"command": "maxpost " + " ".join(RECIPES[recipe][1])})
        per_seed = entry.setdefault("per_seed", {})
        if "0" not in per_seed and not fresh:   # seed 0 as the record gave it
            per_seed["0"] = {k: entry[k] for k in ("exit_code", "wall_s", "pass@1_before", "pass@1_after", "printed")}
        for side in sorted(base.glob(f"{recipe}-s*.json")):
            seed = side.stem.split("-s")[-1]
            info = json.loads(side.read_text())
            info |= {k: [round(x, 2) for x in info[k]] for k in ("load_average_start", "load_average_end")}
            ours = seed != "0" or fresh or "started" in per_seed.get("0", {})   # else a rerun of the record's seed 0
            totals = rollout_totals(base / f"s{seed}" / f"embedded-{side.stem}")
            per_seed[seed if ours else "0_rerun"] = {**info, "wall_min": round(info["wall_s"] / 60, 1),
                                                     **parse(base / f"{side.stem}.log"),
                                                     **({"rollout_totals": totals} if totals else {})}
        seeds = [s for s in ("0", "1", "2") if s in per_seed]
        today = [s for s in ("0_rerun", "1", "2") if s in per_seed] + (["0"] if "started" in per_seed.get("0", {}) else [])
        entry["mean"] = summary(per_seed, seeds, today)
        if not fresh: rec["about_seeds"] = SEEDS_ABOUT
        path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
        m = entry["mean"]
        print(recipe, m["seeds"], m["pass@1_after_per_seed"], m["pass@1_after"], "+-", m["pass@1_after_sd"],
              "gain", m["gain_mean"], "+-", m["gain_sd"], "rerun 0:", per_seed.get("0_rerun", {}).get("pass@1_after"))


if __name__ == "__main__":
    cmd, base, rest = sys.argv[1], Path(sys.argv[2]).resolve(), sys.argv[3:]
    if cmd == "run":
        for recipe, seed in zip(rest[::2], rest[1::2]): run(base, recipe, int(seed))
    else: record(base)
