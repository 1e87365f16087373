"""Preference data's preparation: `PairData` (DPO, the reward model) and `ExampleData` (KTO) over the embedded task's
pairs, this checkout against `--before DIR` (another checkout, e.g. a `git worktree` of an older commit), in
interleaved rounds.

Each measurement is its own process (this script with `--worker`, the checkout on `PYTHONPATH`) that reads the pairs
(jsonl) and the task's tokenizer, times `PairData(...)` on every pair and `ExampleData(...)` on the same pairs
unpaired, and prints the seconds and a hash of the encodings; every process must give the same hash, or the script
fails. The parent writes the embedded task (`prepare_task`, `write_embedded_pairs`) into a temporary directory once.

    python bench/pair_data.py --before /tmp/bc-before --rounds 3
"""
import argparse, hashlib, json, os, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(task: Path) -> None:
    from transformers import AutoTokenizer
    from maxpost.dpo import ExampleData, PairData, unpair
    tok = AutoTokenizer.from_pretrained(str(task))
    rows = [json.loads(l) for l in open(task / "dpo_train.jsonl")]
    t = time.perf_counter(); pairs = PairData(rows, tok, 256, 256); t_pairs = time.perf_counter() - t
    examples = unpair(rows)
    t = time.perf_counter(); ex = ExampleData(examples, tok, 256, 256); t_ex = time.perf_counter() - t
    h = hashlib.sha256(json.dumps([pairs._encoded, ex._encoded], default=list).encode()).hexdigest()[:16]
    print("RESULT " + json.dumps({"pairs": len(rows), "pairs_s": t_pairs, "examples": len(examples), "examples_s": t_ex,
                                  "hash": h}), flush=True)


def run(checkout: Path, task: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, "--worker", str(task)], env=env, capture_output=True, text=True,
                         cwd=checkout, check=True).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=False, help="another checkout to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker: worker(Path(a.worker)); return 0
    sys.path.insert(0, str(ROOT))
    from maxpost.tasks import prepare_task
    from maxpost.dpo import write_embedded_pairs
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "task"
        prepare_task(task); write_embedded_pairs(task)
        sides = {"before": Path(a.before).resolve()} if a.before else {}
        sides["after"] = ROOT
        got = {s: [] for s in sides}
        for r in range(a.rounds):
            for s, checkout in sides.items():
                got[s].append(run(checkout, task))
                g = got[s][-1]
                print(f"round {r + 1} {s:6s}: {g['pairs']} pairs {g['pairs_s']:.2f} s, {g['examples']} examples "
                      f"{g['examples_s']:.2f} s (hash {g['hash']})", flush=True)
    hashes = {g["hash"] for gs in got.values() for g in gs}
    if len(hashes) > 1: print(f"the encodings differ: {sorted(hashes)}"); return 1
    med = lambda xs: sorted(xs)[len(xs) // 2]
    for key in ("pairs_s", "examples_s"):
        line = ", ".join(f"{s} {med([g[key] for g in gs]):.2f} s" for s, gs in got.items())
        if "before" in got:
            ratios = [b[key] / x[key] for b, x in zip(got["before"], got["after"])]
            line += f"; before / after per round {', '.join(f'{q:.2f}' for q in ratios)} (median {med(ratios):.2f})"
        print(f"{key[:-2]} (median of {a.rounds}): {line}")
    print(f"load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
