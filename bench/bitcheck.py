"""Bit-identity of two checkouts: the same runs through `python -m maxpost.cli` in each, every metrics.jsonl record compared.

A refactor of the harness must leave every run's numbers as they were. This script runs, for checkout A and checkout B
(each with its own PYTHONPATH, each as a subprocess, each into its own temporary base_output_directory):

    sft steps=30                                      (run_name=sft)
    rl  steps=2 from that SFT run                     (run_name=rl; beta>0 by default: the reference policy runs)
    rl  steps=2 lora_rank=4 beta=0.04 from it         (run_name=rl_lora: the reference is the base, adapters off)
    sft steps=6 lora_rank=4                           (run_name=sft_lora)

and compares their metrics.jsonl record by record, ignoring the keys that measure time (names containing "timing",
"seconds", "tokens_per_s", "mfu" or "time"). Every other value must be identical (not close: identical).

    python bench/bitcheck.py --a /work/wt-harness --b /work/main [--extra eval_num_prompts=16 ...] [--keep] [--b-dir DIR]

Both checkouts run with the same environment: JAX_PLATFORMS=cpu and no XLA_FLAGS (the CLI sets no flags of its own),
the same interpreter (`--python`, default this one), cwd = the checkout. Exit code 0 when every record agrees.
"""
from __future__ import annotations
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

TIMING_WORDS = ("timing", "seconds", "tokens_per_s", "mfu", "time")

RUNS = [  # (run_name, command, arguments); {d} is the checkout's base_output_directory
    ("sft", "sft", ["steps=30"]),
    ("rl", "rl", ["steps=2", "load_parameters_path={d}/sft"]),
    ("rl_lora", "rl", ["steps=2", "lora_rank=4", "beta=0.04", "load_parameters_path={d}/sft"]),
    ("sft_lora", "sft", ["steps=6", "lora_rank=4"]),
]


def is_timing(key: str) -> bool:
    "Whether a metric's name says it measures time (then two runs may differ in it)."
    return any(w in key for w in TIMING_WORDS)


def records(path: Path) -> list[dict]:
    "The records of a metrics.jsonl without their timing keys."
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in path.read_text().splitlines() if line.strip()]


def differences(a: list[dict], b: list[dict]) -> list[str]:
    "Every difference between two lists of records, as lines."
    out = [] if len(a) == len(b) else [f"{len(a)} records vs {len(b)}"]
    for i, (ra, rb) in enumerate(zip(a, b)):
        for k in sorted(set(ra) | set(rb)):
            if k not in ra or k not in rb: out.append(f"record {i} (step {ra.get('step')}): key {k!r} only in one")
            elif ra[k] != rb[k] and not (ra[k] != ra[k] and rb[k] != rb[k]):   # NaN == NaN here
                out.append(f"record {i} (step {ra.get('step')}, {ra.get('kind')}): {k} = {ra[k]!r} vs {rb[k]!r}")
    return out


def run_all(checkout: Path, base: Path, python: str, extra: list[str], log) -> dict[str, float]:
    "Run every entry of RUNS in `checkout` into `base`; returns seconds per run."
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(checkout))
    seconds = {}
    for name, cmd, args in RUNS:
        argv = [python, "-m", "maxpost.cli", cmd, f"run_name={name}", f"base_output_directory={base}",
                *[a.format(d=base) for a in args], *extra]
        print(f"[{checkout}] {' '.join(argv[3:])}", file=log, flush=True)
        t0 = time.perf_counter()
        p = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
        seconds[name] = time.perf_counter() - t0
        (base / f"{name}.log").write_text(p.stdout + p.stderr)
        if p.returncode:
            raise SystemExit(f"{checkout}: `maxpost {cmd}` ({name}) exited {p.returncode}; log: {base / (name + '.log')}\n"
                             + (p.stdout + p.stderr)[-3000:])
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, default=Path(__file__).resolve().parent.parent, help="checkout A (default: this one)")
    ap.add_argument("--b", type=Path, default=Path("/work/main"), help="checkout B (default: /work/main)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--extra", nargs="*", default=[], help="key=value added to every run (both checkouts)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--b-dir", type=Path, help="compare with B's runs already in this directory (a kept run) instead of running B")
    a = ap.parse_args(argv)
    bases = {}
    if a.b_dir: bases["b"] = a.b_dir.resolve()
    try:
        for side, checkout in (("a", a.a.resolve()), ("b", a.b.resolve())):
            if side in bases: print(f"{side} = the runs under {bases[side]}"); continue
            bases[side] = Path(tempfile.mkdtemp(prefix=f"bitcheck_{side}_"))
            secs = run_all(checkout, bases[side], a.python, a.extra, sys.stderr)
            print(f"{side} = {checkout} ({subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=checkout, capture_output=True, text=True).stdout.strip()}): "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()))
        bad = 0
        for name, *_ in RUNS:
            ra, rb = (records(bases[s] / name / "metrics.jsonl") for s in "ab")
            diff = differences(ra, rb)
            keys = sorted({k for r in ra for k in r})
            print(f"{name}: {len(ra)} records, {len(keys)} keys compared: " + ("IDENTICAL" if not diff else f"{len(diff)} DIFFERENCES"))
            for line in diff[:20]: print("   ", line)
            bad += bool(diff)
        return 1 if bad else 0
    finally:
        if a.keep: print("run directories:", *bases.values())
        else:
            for side, d in bases.items():
                if not (side == "b" and a.b_dir): shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
