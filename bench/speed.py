"""maxpost's 20M rows of bench/README.md for two checkouts, in interleaved rounds: did a change make them slower?

The SFT step (`sft_throughput.py`: seq 512, batch 8), the rollout (`rollout.py`: batch 64, 32 prompt + 128 new
tokens) and the GRPO step (`grpo_step.py`: 8 prompts x G = 4, 32 + 64 tokens), each the maxpost worker of *that
checkout's own* bench script (so each side runs with the API it has), in its own process; a round runs every
(row, checkout) pair once, alternating the checkouts, so a host that speeds up or slows down touches both alike.
Ratios are after / before of the time (median over rounds of the per-round ratio), so below 1 is faster.

    python bench/speed.py --before ../maxpost-before --rounds 3
    python bench/speed.py --before ../maxpost-before --report     # the table from bench/results/speed_20m.json
"""
from __future__ import annotations
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

ROWS = {   # name: (script, worker args, seconds of one measurement from the worker's record)
    "SFT step": ("sft_throughput.py", ["--shape", "20m", "--seq", "512", "--batch", "8", "--warmup", "2", "--reps", "5"],
                 lambda r: r["median_step_s"]),
    "rollout, batch 64": ("rollout.py", ["--shape", "20m", "--batches", "64", "--prompt", "32", "--new", "128",
                                         "--warmup", "2", "--reps", "3", "--hf-reps", "1"],
                          lambda r: r["batches"]["64"]["median_s"]),
    "GRPO step": ("grpo_step.py", ["--shape", "20m", "--prompts", "8", "--G", "4", "--prompt", "32", "--new", "64",
                                   "--warmup", "2", "--reps", "3"], lambda r: r["median_step_s"]),
}


def run_row(checkout: Path, row: str) -> dict:
    "The maxpost worker of `checkout`'s own bench script for `row`."
    script, args, _ = ROWS[row]
    return common.run_worker(script, ["--worker", "maxpost", *args], checkout=checkout, timeout=1800)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the earlier maxpost")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--report", action="store_true", help="measure nothing: the table of bench/results/speed_20m.json")
    a = ap.parse_args(argv)
    checkouts = {"before": a.before.resolve(), "after": Path(__file__).resolve().parent.parent}
    out = Path(__file__).resolve().parent / "results" / "speed_20m.json"
    if a.report: rounds = json.loads(out.read_text())["rounds"]
    else:
        rounds = []
        for r in range(a.rounds):
            rec = {}
            order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]   # alternate who goes first
            for row in a.rows:
                for label in order:
                    rec.setdefault(row, {})[label] = x = run_row(checkouts[label], row)
                    print(f"round {r} {row} {label}: {ROWS[row][2](x) if 'error' not in x else x}", flush=True)
            rounds.append(rec)
            common.save_results("speed_20m", {"rounds": rounds, "checkouts": {k: str(v) for k, v in checkouts.items()},
                                              "args": {k: str(v) for k, v in vars(a).items()}})
    rows = []
    for row in a.rows:
        seconds = {lab: [ROWS[row][2](rec[row][lab]) for rec in rounds if "error" not in rec[row][lab]]
                   for lab in checkouts}
        ratios = [ROWS[row][2](rec[row]["after"]) / ROWS[row][2](rec[row]["before"]) for rec in rounds
                  if not any("error" in rec[row][lab] for lab in checkouts)]
        rows.append(dict(row=row, before=round(common.median(seconds["before"]), 3),
                         after=round(common.median(seconds["after"]), 3),
                         ratio=round(common.median(ratios), 3) if ratios else None,
                         range=f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else ""))
    table = common.print_table("maxpost's 20M rows, before and after (seconds; median over rounds)", rows,
                               [("row", "row"), ("before", "before (s)"), ("after", "after (s)"),
                                ("ratio", "after / before"), ("range", "per-round range")])
    (out.with_suffix(".md")).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
