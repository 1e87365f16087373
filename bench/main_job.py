"""Wall time of the main job (`maxpost sft && maxpost rl` with their defaults, the README's command) for two
checkouts of maxpost in the same session, in interleaved rounds (before, after, before, after, ...), so that both
see the same machine. Each command runs as a subprocess with the checkout first on `PYTHONPATH`, into a fresh
output directory; the time includes process start, data preparation and the evaluations the RL run does.

    git worktree add ../maxpost-before b650bc3
    .venv/bin/python bench/main_job.py --before ../maxpost-before --rounds 2
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run(checkout: Path, cmd: str, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maxpost" if (checkout / "maxpost" / "__main__.py").exists() else "maxpost.cli",
                    cmd, f"base_output_directory={out}"], check=True, env=env, cwd=checkout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main_job(checkout: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="maxpost-main-job-") as d:
        sft = run(checkout, "sft", Path(d))
        rl = run(checkout, "rl", Path(d))
    return dict(sft_s=round(sft, 1), rl_s=round(rl, 1), total_s=round(sft + rl, 1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the earlier maxpost")
    p.add_argument("--after", type=Path, default=HERE, help="the checkout to compare (default: this one)")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    rows = {"before": [], "after": []}
    for r in range(a.rounds):
        for name in ("before", "after"):
            t = main_job(getattr(a, name).resolve())
            rows[name].append(t)
            print(json.dumps({"round": r, "checkout": name, **t}), flush=True)
    med = {k: statistics.median(x["total_s"] for x in v) for k, v in rows.items()}
    print(f"main job, median of {a.rounds} rounds: before {med['before'] / 60:.1f} min, after {med['after'] / 60:.1f} min, "
          f"after/before {med['after'] / med['before']:.2f}")
