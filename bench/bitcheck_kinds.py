"""Bit-identity of the kinds across two checkouts: a 5-step SFT, RL and DPO on the embedded default, metrics compared.

A structural refactor (chapters moved, the setup built by the command, kinds registered where they live) must leave
every kind's numbers as they were. For `--before DIR` and `--after DIR` this runs, each checkout with its own
PYTHONPATH, as subprocesses of `python -m maxpost.cli`, into its own directory under /tmp:

    sft steps=5        (run_name=embedded-sft: where rl and dpo start by default)
    rl  steps=5        (run_name=rl)
    dpo steps=5        (run_name=dpo)

and compares their metrics.jsonl record by record, leaving out the keys under `timing/` (and every key that
bench/bitcheck.py counts as time). Every other value must be identical, not close.

    python bench/bitcheck_kinds.py --before /tmp/i48-before --after . [--before-dir DIR] [--keep]

`--before-dir` / `--after-dir` reuse the runs kept by an earlier call (`--keep`). Exit 0 when every record agrees.
"""
from __future__ import annotations
import argparse, shutil, subprocess, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bitcheck  # noqa: E402  (records, differences, run_all: one comparison for both scripts)

KIND_RUNS = [("embedded-sft", "sft", ["steps=5"]), ("rl", "rl", ["steps=5"]), ("dpo", "dpo", ["steps=5"])]   # rl and dpo start from the SFT run (their default load_parameters_path)


def records(path: Path) -> list[dict]:
    "The records of a metrics.jsonl without any timing key."
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in bitcheck.records(path)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--after", type=Path, required=True, help="the checkout after the change")
    ap.add_argument("--before-dir", type=Path, help="the before-runs kept by an earlier call (skips running before)")
    ap.add_argument("--after-dir", type=Path, help="the after-runs kept by an earlier call (skips running after)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    a = ap.parse_args(argv)
    bitcheck.RUNS[:] = KIND_RUNS
    bases = {s: d.resolve() for s, d in (("before", a.before_dir), ("after", a.after_dir)) if d}
    try:
        for side, checkout in (("before", a.before.resolve()), ("after", a.after.resolve())):
            if side in bases: print(f"{side} = the runs under {bases[side]}"); continue
            bases[side] = Path(tempfile.mkdtemp(prefix=f"bitcheck_kinds_{side}_", dir="/tmp"))
            secs = bitcheck.run_all(checkout, bases[side], a.python, [], sys.stderr)
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
            print(f"{side} = {checkout} ({rev}): " + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()))
        bad = 0
        for name, *_ in KIND_RUNS:
            rb, ra = (records(bases[s] / name / "metrics.jsonl") for s in ("before", "after"))
            diff = bitcheck.differences(rb, ra)
            keys = sorted({k for r in rb for k in r})
            print(f"{name}: {len(rb)} records, {len(keys)} keys compared: " + ("IDENTICAL" if not diff else f"{len(diff)} DIFFERENCES"))
            for line in diff[:20]: print("   ", line)
            bad += bool(diff) or not rb
        return 1 if bad else 0
    finally:
        if a.keep: print("run directories:", *bases.values())
        else:
            for side, d in bases.items():
                if not {"before": a.before_dir, "after": a.after_dir}[side]: shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
