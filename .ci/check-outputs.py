#!/usr/bin/env python
"""Fails when a committed notebook output (nbs/**/*.ipynb) holds a traceback or an absolute path of a developer's
machine (under /home, /work, /root, /Users, /tmp, or a .venv). Prints one line per offending cell; exit 1 if any.

    python .ci/check-outputs.py [ROOT] [NOTEBOOK ...]
"""
import json, re, sys
from pathlib import Path

BAD = [("a traceback", re.compile(r"Traceback \(most recent call last\)|^\w*(Error|Exception)\b.*\n?$", re.M)),
       ("an absolute path", re.compile(r"(?<![\w.])(/home/|/work/|/root/|/Users/|/tmp/|[\w./-]*\.venv/)"))]


def output_text(out: dict) -> str:
    if out.get("output_type") == "error": return "Traceback (most recent call last)\n" + "\n".join(out.get("traceback", []))
    text = out.get("text", "")
    data = out.get("data", {})
    for k in ("text/plain", "text/html", "text/markdown"): text += "".join(data.get(k, ""))
    return "".join(text) if isinstance(text, list) else text


def problems(nb_path: Path) -> list[str]:
    nb, found = json.loads(nb_path.read_text()), []
    for i, cell in enumerate(nb.get("cells", [])):
        for out in cell.get("outputs", []):
            text = output_text(out)
            for what, rx in BAD:
                m = rx.search(text)
                if m: found.append(f"{nb_path}: cell {i} output holds {what}: {m.group(0).strip()[:80]!r}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv and Path(argv[0]).is_dir() else Path(__file__).resolve().parent.parent
    nbs = [Path(a) for a in argv[1:]] if len(argv) > 1 else sorted((root / "nbs").rglob("*.ipynb"))
    found = [p for nb in nbs if ".ipynb_checkpoints" not in str(nb) for p in problems(nb)]
    for line in found: print(line, file=sys.stderr)
    if found: print(f"check-outputs: {len(found)} committed outputs to clean (regenerate: .ci/execute-notebooks.py NB)", file=sys.stderr)
    else: print("check-outputs: committed outputs clean")
    return 1 if found else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
