"""Where the wall time of each maxpost command goes (issue 41 item 1): time to first step in parts, and host overhead.

Runs `maxpost sft`, `rl`, `dpo` and `eval` on the embedded default with small step counts, each in a subprocess
(`python -m maxpost.cli <kind> base_output_directory=<tmp> steps=N log_period=1 ...`; rl, dpo and eval start from the
sft run's checkpoint), and reads what each run wrote:

- `timing.json`: `first_step` (startup, data, weights, compile, compiles, memory_check, first_eval, total) and
  `steps` (the per-step parts step, device, input, host, log, checkpoint, eval: means over steps 2..N);
- `metrics.jsonl`: the `timing/*` keys of every logged train record (log_period=1: one record a step).

Where a run has no timing.json (maxpost before issue 41) the table falls back to what exists: the wall time from the
process's start to its first logged train step (seen from here, by watching metrics.jsonl) and the mean
`timing/step` of steps 2..N; the parts it lacks show as "—". Host overhead per step = wall step - device step.
"parts = step?" and "parts = first?" say whether the parts add to within 5 % of the wall step and of the time to
first step (the named parts: an `other` that a run reports, the rest it cannot name, is shown but not added); "first = seen?" whether timing.json's time to first step is within 5 % of the one seen from here (from
the process's launch: a run clock that starts after the imports falls short of it).

    .venv/bin/python bench/overhead.py                     # this checkout -> bench/results/overhead.json
    .venv/bin/python bench/overhead.py --quick             # fewer steps and prompts: a smoke run
    git worktree add ../maxpost-before <commit>
    .venv/bin/python bench/overhead.py --before ../maxpost-before --after . --rounds 3   # interleaved rounds

Each checkout runs with itself first on PYTHONPATH (its own maxpost). Runs go to a temporary directory, their logs too
(kept with --keep).
"""
from __future__ import annotations
import argparse, json, os, shutil, signal, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("sft", "rl", "dpo", "eval")
FIRST_PARTS = ("startup", "data", "backend", "weights", "compile", "memory_check", "first_eval", "resume", "logger", "first_run")
STEP_PARTS = ("device", "input", "host", "log", "checkpoint", "eval")
TOLERANCE = 0.05
DASH = "—"

# Small runs of the embedded default: enough steps for a steady mean over steps 2..N; checkpoints only at the end.
FULL = {"sft": ["steps=20"], "rl": ["steps=6"], "dpo": ["steps=10"], "eval": []}
QUICK = {"sft": ["steps=4"], "rl": ["steps=3", "eval_num_prompts=16", "eval_k=0"],
         "dpo": ["steps=3", "eval_num_prompts=16", "eval_k=0", "eval_batches=1"],
         "eval": ["eval_num_prompts=16", "eval_k=0"]}


def command_args(kind: str, base: Path, quick: bool) -> list[str]:
    "The key=value arguments of `kind`'s small run under `base`; rl, dpo and eval load the sft run."
    args = [f"base_output_directory={base}", f"run_name=ovh-{kind}"]
    if kind != "eval": args += ["log_period=1", "checkpoint_period=100000"]
    if kind == "sft": args += ["eval_interval=0"]
    if kind != "sft": args += [f"load_parameters_path={base / 'ovh-sft'}"]
    return args + (QUICK if quick else FULL)[kind]


def new_records(path: Path, seen: int) -> tuple[list[dict], int]:
    "The complete lines of `path` past byte `seen` as records, and the new byte offset."
    try:
        with path.open("rb") as f: f.seek(seen); chunk = f.read()
    except FileNotFoundError: return [], seen
    end = chunk.rfind(b"\n") + 1
    return [json.loads(l) for l in chunk[:end].splitlines() if l.strip()], seen + end


def launch(checkout: Path, argv: list[str], run_dir: Path, log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run `python -m maxpost.cli *argv` with `checkout` first on the path, watching `run_dir/metrics.jsonl`.

    Returns the process wall time, the time each record of metrics.jsonl appeared (`arrivals`: [step, kind, s]), the
    exit code and whether it ran out of time. Past `timeout` it gets SIGTERM (maxpost saves a checkpoint and stops),
    30 s later SIGKILL."""
    env = dict(env or os.environ)   # the checkout first; what PYTHONPATH held stays after it (a TPU host's JAX)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "maxpost.cli", *argv]
    arrivals, seen, timed_out, t0 = [], 0, False, time.perf_counter()
    with log.open("w") as out:
        out.write("$ PYTHONPATH=" + str(checkout) + " " + " ".join(cmd[1:]) + "\n"); out.flush()
        p = subprocess.Popen(cmd, env=env, cwd=str(checkout), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while p.poll() is None:
            time.sleep(0.02)
            recs, seen = new_records(run_dir / "metrics.jsonl", seen)
            arrivals += [[r.get("step"), r.get("kind"), time.perf_counter() - t0] for r in recs]
            if not timed_out and time.perf_counter() - t0 > timeout:
                timed_out = True; p.send_signal(signal.SIGTERM)
            if timed_out and time.perf_counter() - t0 > timeout + 30:
                os.killpg(p.pid, signal.SIGKILL); p.wait()
    wall = time.perf_counter() - t0
    recs, seen = new_records(run_dir / "metrics.jsonl", seen)
    arrivals += [[r.get("step"), r.get("kind"), wall] for r in recs]
    return {"wall_s": wall, "arrivals": arrivals, "returncode": p.returncode, "timed_out": timed_out, "log": str(log)}


def read_json(path: Path) -> dict | None:
    try: return json.loads(path.read_text())
    except (OSError, ValueError): return None


def train_records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    recs = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
    return [r for r in recs if r.get("kind") == "train"]


def mean(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.fmean(xs) if xs else None


def steady_parts(timing: dict | None, records: list[dict]) -> dict:
    """Per-step means past the first logged record (which holds step 1, compilation included): `step` (wall) and the
    parts that add up to it. From timing.json's `steps` (keys with or without `timing/`): every part it has, STEP_PARTS
    and any other (rewards, ...); else from metrics.jsonl's `timing/<part>` of STEP_PARTS (None where missing: a
    record also holds older `timing/*` keys that overlap them). Also `mfu` where logged, and `parts`: the names summed."""
    later = records[1:]
    from_file = {k.removeprefix("timing/"): v for k, v in ((timing or {}).get("steps") or {}).items()}
    if from_file:
        out = {k: from_file.get(k) for k in ("step", *STEP_PARTS)} | from_file
        out["parts"] = [k for k in out if k != "step"]
    else:
        out = {k: mean([r.get(f"timing/{k}") for r in later]) for k in ("step", *STEP_PARTS)}
        out["parts"] = list(STEP_PARTS)
    out["mfu"] = mean([r.get("mfu") for r in later])
    out["steps_timed"] = (timing or {}).get("steps_timed", len(later))
    return out


def adds_up(total: float | None, parts: list) -> bool | None:
    "Whether `parts` sum to within TOLERANCE of `total`; None when any is missing."
    if total is None or not total or any(p is None for p in parts): return None
    return abs(sum(parts) - total) <= TOLERANCE * total


def summarize(kind: str, launched: dict, run_dir: Path) -> dict:
    "One row: time to first step and its parts, steady wall / device step, host overhead, and the 5 % checks."
    timing = read_json(run_dir / "timing.json")
    first = (timing or {}).get("first_step") or {}
    seen_first = next((s for step, k, s in launched["arrivals"] if k == "train"), None)
    records = train_records(run_dir)
    steady = steady_parts(timing, records)
    summed = steady.pop("parts")
    row = {"kind": kind, "wall_s": launched["wall_s"], "returncode": launched["returncode"],
           "timed_out": launched["timed_out"], "timing_json": timing is not None, "steps_done": len(records),
           "first_step_seen_s": seen_first, "first_step_s": first.get("total", seen_first),
           "compiles": first.get("compiles"), **{f"first/{k}": first.get(k) for k in (*FIRST_PARTS, "other")},
           **{f"step/{k}": v for k, v in steady.items()}}
    wall, device = steady["step"], steady["device"]
    if wall is not None and device is not None:
        row["host_ms"], row["host_pct"] = 1e3 * (wall - device), 100 * (wall - device) / wall
    row["first_sum_ok"] = adds_up(first.get("total"), [first.get(k) for k in FIRST_PARTS])
    row["first_seen_ok"] = adds_up(seen_first, [first.get("total")])   # the run's own clock misses no start-up
    row["step_sum_ok"] = adds_up(wall, [steady[k] for k in summed])
    return row


def run_checkout(checkout: Path, quick: bool, work: Path, timeout: float, cold: bool = False) -> list[dict]:
    """Every kind once, in order (sft first: the others load its checkpoint), into a fresh directory under `work`;
    `cold`: with a maxpost cache directory of their own (compiled programs, tokenized data), empty at the start."""
    base = Path(tempfile.mkdtemp(prefix="ovh-", dir=work))
    env = dict(os.environ, MAXPOST_CACHE_DIR=str(base / "cache")) if cold else None
    rows = []
    for kind in KINDS:
        launched = launch(checkout, [kind, *command_args(kind, base, quick)], base / f"ovh-{kind}", base / f"{kind}.log",
                          timeout, env)
        rows.append(summarize(kind, launched, base / f"ovh-{kind}"))
        print(json.dumps({"checkout": str(checkout), **{k: v for k, v in rows[-1].items() if v is not None}}), flush=True)
    return rows


def fmt(v, digits: int = 3) -> str:
    if v is None: return DASH
    if isinstance(v, bool): return "yes" if v else "no"
    if isinstance(v, float): return f"{v:.0f}" if abs(v) >= 100 else f"{v:.{digits}g}"
    return str(v)


def ms(v): return None if v is None else 1e3 * v


def table(rows: list[tuple[str, dict]]) -> str:
    """A markdown table of (label, row): process wall time and time to first step with its parts (s), then the
    steady step (ms) and its host overhead."""
    head = ["command", "process s", "first step s", "seen s", "startup", "data", "backend", "weights", "compile (n)", "memory check",
            "first eval", "resume", "logger", "first step run", "other", "parts = first?", "first = seen?", "wall step ms", "device ms", "host ms", "host %", "parts = step?", "exit"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, r in rows:
        compile_ = fmt(r["first/compile"]) + (f" ({r['compiles']})" if r.get("compiles") is not None else "")
        status = "timeout" if r["timed_out"] else str(r["returncode"])
        cells = [label, fmt(r["wall_s"]), fmt(r["first_step_s"]), fmt(r["first_step_seen_s"]),
                 *(fmt(r[f"first/{k}"]) for k in FIRST_PARTS[:4]), compile_, fmt(r["first/memory_check"]),
                 *(fmt(r[f"first/{k}"]) for k in FIRST_PARTS[6:]), fmt(r["first/other"]), fmt(r["first_sum_ok"]), fmt(r.get("first_seen_ok")),
                 fmt(ms(r["step/step"])), fmt(ms(r["step/device"])), fmt(r.get("host_ms")), fmt(r.get("host_pct"), 2),
                 fmt(r["step_sum_ok"]), status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    "Per command, the median over rounds of every number (the first round's value for the rest)."
    out = []
    for per_kind in zip(*rounds):
        row = dict(per_kind[0])
        for k, v in row.items():
            vals = [r.get(k) for r in per_kind]
            if isinstance(v, float) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
                row[k] = statistics.median(vals)
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and held-out prompts: a smoke run")
    p.add_argument("--before", type=Path, help="a checkout of the earlier maxpost (with --after: a before/after table)")
    p.add_argument("--after", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; with --before the checkouts alternate each round")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command before it is stopped")
    p.add_argument("--cold-cache", action="store_true", help="each round starts from an empty maxpost cache (a first "
                   "run: every program compiled, the data tokenized); default: the user's cache as it is")
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs (their path is printed)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overhead.json")
    a = p.parse_args(argv)
    checkouts = {"before": a.before.resolve(), "after": a.after.resolve()} if a.before else {"": a.after.resolve()}
    work = Path(tempfile.mkdtemp(prefix="maxpost-overhead-"))
    rounds = {name: [] for name in checkouts}
    t0 = time.perf_counter()
    try:
        for r in range(a.rounds):
            for name, checkout in checkouts.items():      # interleaved: before, after, before, after, ...
                print(f"round {r + 1}/{a.rounds} {name or checkout}", flush=True)
                rounds[name].append(run_checkout(checkout, a.quick, work, a.timeout, a.cold_cache))
    finally:
        if a.keep: print(f"runs and logs kept in {work}")
        else: shutil.rmtree(work, ignore_errors=True)
    medians = {name: median_rows(rs) for name, rs in rounds.items()}
    text = table([(f"{r['kind']} {name}".strip(), r) for rows in zip(*medians.values()) for name, r in zip(medians, rows)])
    print(f"\n{text}\n\n{a.rounds} round(s), median per command; {time.perf_counter() - t0:.0f} s in all")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"argv": sys.argv[1:], "quick": a.quick, "rounds": a.rounds, "cold_cache": a.cold_cache,
                                 "checkouts": {k: str(v) for k, v in checkouts.items()},
                                 "median": medians, "all_rounds": rounds, "table": text}, indent=1))
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
