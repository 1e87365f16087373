"""The embedded-default study: for each seed, the main job (`maxpost sft`, then `maxpost rl` — GRPO),
`maxpost rl loss_algo=gspo` and `maxpost dpo` from the same SFT checkpoint, all with their default configs, then
`maxpost eval` of each checkpoint on held-out problems (greedy pass@1 and pass@k). Prints one row per seed, the
mean gain of each algorithm over SFT with its seed-to-seed standard deviation, and the wall time of `maxpost sft` +
`maxpost rl` (the main job). Finished stages are skipped on a rerun (their results are read back), so
`--algos dpo` adds DPO to an earlier GRPO / GSPO study, and `--algos grpo-k1` asynchronous GRPO (`max_staleness=1
rollout_devices=4` on 8 virtual CPU devices). Its records made before 2026-12-06 vary the task too: `seed=` then also
drew the embedded task's problems; since then the task is always written from `maxpost.tasks.TASK_SEED` and a seed
varies only the run (initialisation, data order, sampling).

    .venv/bin/python bench/embedded_study.py --seeds 0 1 2 --out maxpost_runs/study
    .venv/bin/python bench/embedded_study.py --seeds 0 1 2 --algos dpo --out maxpost_runs/study
"""
import argparse, json, os, statistics, subprocess, sys, time
from pathlib import Path


def maxpost(*args: str, devices: int | None = None) -> float:
    "Run one `maxpost` command (on `devices` virtual CPU devices if given); returns its wall time in seconds."
    env = dict(os.environ)
    if devices: env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maxpost.cli", *args], check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


# stage -> (command and its extra keys, the run directory the defaults name)
STAGES = {"sft": (["sft"], "embedded-sft"), "grpo": (["rl"], "embedded-grpo"),
          "gspo": (["rl", "loss_algo=gspo"], "embedded-gspo"), "dpo": (["dpo"], "embedded-dpo"),
          # asynchronous GRPO (chapter 15c): rollouts one step stale, on 4 of 8 virtual devices of their own
          "grpo-k1": (["rl", "max_staleness=1", "rollout_devices=4", "run_name=embedded-grpo-k1"], "embedded-grpo-k1")}
DEVICES = {"grpo-k1": 8}   # every other stage runs on what the host gives (1 CPU device unless XLA_FLAGS says more)


def run_seed(seed: int, out: Path, eval_num_prompts: int, eval_k: int, algos: list[str]) -> dict:
    "Train and evaluate SFT and each of `algos` for one seed; a stage with a result file is read back, not rerun."
    d = out / f"seed{seed}"
    done = d / "study.json"
    rec = json.loads(done.read_text()) if done.exists() else {"seed": seed, "times_s": {}, "results": {}}
    for stage in ["sft", *algos]:
        if stage in rec["results"]: continue
        (cmd, *extra), run = STAGES[stage]
        common = [f"base_output_directory={d}", f"seed={seed}"]
        rec["times_s"][stage] = maxpost(cmd, *common, *extra, devices=DEVICES.get(stage))
        maxpost("eval", *common, f"load_parameters_path={d / run}", f"run_name=eval-{stage}",
                f"eval_num_prompts={eval_num_prompts}", f"eval_k={eval_k}")
        rec["results"][stage] = json.loads((d / f"eval-{stage}" / "eval.json").read_text())["metrics"]
        done.write_text(json.dumps(rec, indent=1))
    print(json.dumps({"seed": seed, "times_s": rec["times_s"],
                      **{s: r["pass@1"] for s, r in rec["results"].items()}}), flush=True)
    return rec


def report(runs: list[dict], k: int) -> str:
    stages = [s for s in STAGES if all(s in r["results"] for r in runs)]
    names = [s.upper() for s in stages]
    head = ("| seed | " + " | ".join(f"{n} pass@1" for n in names) + " | "
            + " | ".join(f"{n} pass@{k}" for n in names) + " | sft + rl wall |")
    lines = [head, "|" + "---|" * (2 + 2 * len(stages))]
    for r in runs:
        res, t = r["results"], r["times_s"]
        cells = [f"{100 * res[s][m]:.1f}" if m in res[s] else "-" for m in ("pass@1", f"pass@{k}") for s in stages]
        wall = f"{(t['sft'] + t['grpo']) / 60:.1f} min" if "grpo" in t else "-"
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + f" | {wall} |")
    out = ["\n".join(lines), ""]
    for algo in stages[1:]:
        gains = [100 * (r["results"][algo]["pass@1"] - r["results"]["sft"]["pass@1"]) for r in runs]
        mean = statistics.mean(gains)
        sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        out.append(f"{algo.upper()}: greedy gain over SFT {mean:+.1f} points, seed std {sd:.1f} "
                   f"(mean > 2 std: {mean > 2 * sd}; goal +10), per seed " + ", ".join(f"{g:+.1f}" for g in gains))
    walls = [(r["times_s"]["sft"] + r["times_s"]["grpo"]) / 60 for r in runs if "grpo" in r["times_s"]]
    if walls: out.append(f"main job (maxpost sft + maxpost rl) wall: {min(walls):.1f}-{max(walls):.1f} min")
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("maxpost_runs/study"))
    p.add_argument("--eval-num-prompts", type=int, default=500)
    p.add_argument("--eval-k", type=int, default=8)
    p.add_argument("--algos", nargs="+", choices=[s for s in STAGES if s != "sft"], default=["grpo", "gspo"])
    a = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    runs = [run_seed(s, a.out.resolve(), a.eval_num_prompts, a.eval_k, a.algos) for s in a.seeds]
    print(report(runs, a.eval_k))
