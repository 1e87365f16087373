"""The embedded-default RL study: for each seed, the main job (`maxpost sft`, then `maxpost rl` — GRPO) and
`maxpost rl loss_algo=gspo` from the same SFT checkpoint, all with their default configs, then `maxpost eval` of
the three checkpoints on held-out problems (greedy pass@1 and pass@k). Prints one row per seed, the mean gain of
each RL algorithm over SFT with its seed-to-seed standard deviation, and the wall time of `maxpost sft` +
`maxpost rl` (the main job). Finished stages are skipped on a rerun (their results are read back).

    .venv/bin/python bench/embedded_study.py --seeds 0 1 2 --out maxpost_runs/study
"""
import argparse, json, os, statistics, subprocess, sys, time
from pathlib import Path


def maxpost(*args: str) -> float:
    "Run one `maxpost` command; returns its wall time in seconds."
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maxpost.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_seed(seed: int, out: Path, eval_num_prompts: int, eval_k: int) -> dict:
    d = out / f"seed{seed}"
    done = d / "study.json"
    if done.exists(): return json.loads(done.read_text())
    common = [f"base_output_directory={d}", f"seed={seed}"]
    times = {"sft": maxpost("sft", *common), "grpo": maxpost("rl", *common),
             "gspo": maxpost("rl", *common, "loss_algo=gspo")}
    results = {}
    for stage, run in (("sft", "embedded-sft"), ("grpo", "embedded-grpo"), ("gspo", "embedded-gspo")):
        maxpost("eval", *common, f"load_parameters_path={d / run}", f"run_name=eval-{stage}",
                f"eval_num_prompts={eval_num_prompts}", f"eval_k={eval_k}")
        results[stage] = json.loads((d / f"eval-{stage}" / "eval.json").read_text())["metrics"]
    rec = {"seed": seed, "times_s": times, "results": results}
    done.write_text(json.dumps(rec, indent=1))
    print(json.dumps({"seed": seed, "times_s": times, **{s: results[s]["pass@1"] for s in results}}), flush=True)
    return rec


def report(runs: list[dict], k: int) -> str:
    head = "| seed | SFT pass@1 | GRPO pass@1 | GSPO pass@1 | SFT pass@{0} | GRPO pass@{0} | GSPO pass@{0} | sft + rl wall |".format(k)
    lines = [head, "|" + "---|" * 8]
    for r in runs:
        res, t = r["results"], r["times_s"]
        cells = [f"{100 * res[s][m]:.1f}" for m in ("pass@1", f"pass@{k}") for s in ("sft", "grpo", "gspo")]
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + f" | {(t['sft'] + t['grpo']) / 60:.1f} min |")
    out = ["\n".join(lines), ""]
    for algo in ("grpo", "gspo"):
        gains = [100 * (r["results"][algo]["pass@1"] - r["results"]["sft"]["pass@1"]) for r in runs]
        mean = statistics.mean(gains)
        sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        out.append(f"{algo.upper()}: greedy gain over SFT {mean:+.1f} points, seed std {sd:.1f} "
                   f"(mean > 2 std: {mean > 2 * sd}; goal +10), per seed " + ", ".join(f"{g:+.1f}" for g in gains))
    walls = [(r["times_s"]["sft"] + r["times_s"]["grpo"]) / 60 for r in runs]
    out.append(f"main job (maxpost sft + maxpost rl) wall: {min(walls):.1f}-{max(walls):.1f} min")
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("maxpost_runs/study"))
    p.add_argument("--eval-num-prompts", type=int, default=500)
    p.add_argument("--eval-k", type=int, default=8)
    a = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    runs = [run_seed(s, a.out.resolve(), a.eval_num_prompts, a.eval_k) for s in a.seeds]
    print(report(runs, a.eval_k))
