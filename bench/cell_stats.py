"""Export-cell sizes of the book: how many `#| export(s)` cells, their average line count, and every one over a limit.

    python bench/cell_stats.py [--nbs nbs] [--limit 40]

A cell's lines are its source lines, the `#| export` directive included (blank lines too). Prints the count, the
average, then `notebook: first code line (N lines)` for each cell over the limit; exit 0 always.
"""
from __future__ import annotations
import argparse, json, re
from pathlib import Path

EXPORT = re.compile(r"^#\|\s*exports?\s*$")


def export_cells(nbs: Path):
    "Yield (notebook name, source lines) for every export cell of the notebooks under `nbs`."
    for nb in sorted(nbs.glob("*.ipynb")):
        for c in json.loads(nb.read_text())["cells"]:
            if c["cell_type"] != "code": continue
            src = "".join(c["source"]).rstrip("\n").split("\n")
            if any(EXPORT.match(l.strip()) for l in src if l.startswith("#|")): yield nb.name, src


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbs", type=Path, default=Path(__file__).resolve().parent.parent / "nbs")
    ap.add_argument("--limit", type=int, default=40)
    a = ap.parse_args(argv)
    cells = list(export_cells(a.nbs))
    n = len(cells)
    print(f"{n} export cells, {sum(len(s) for _, s in cells) / max(n, 1):.1f} lines on average")
    long = sorted(((len(s), nb, s) for nb, s in cells if len(s) > a.limit), reverse=True)
    print(f"{len(long)} over {a.limit} lines")
    for k, nb, s in long:
        first = next((l for l in s if l.strip() and not l.startswith("#|")), "")
        print(f"  {nb}: {first.strip()[:90]} ({k} lines)")


if __name__ == "__main__": main()
