"""Every number README.md reports comes from a committed record (issue 49, item B): a result line carries
`<!-- record: bench/results/FILE.json key.path [key.path ...] -->`, and each value at those key paths is printed on
that line. A line with a percentage or a time in minutes and no record marker fails, so a number cannot come back
into the README without the record of the command that produced it."""
import json, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- record: (\S+) ([^>]*?) -->")
RESULT = re.compile(r"\d+(?:\.\d+)? ?(?:%|min\b)")        # a percentage or a time in minutes
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def lookup(record: dict, path: str):
    v = record
    for part in path.split("."):
        assert isinstance(v, dict) and part in v, f"{path}: no {part!r} in the record"
        v = v[part]
    return v


def readme_lines() -> list[tuple[int, str]]:
    return list(enumerate((ROOT / "README.md").read_text().splitlines(), start=1))


def test_every_result_line_names_its_record():
    bare = [(n, l) for n, l in readme_lines() if RESULT.search(MARKER.sub("", l)) and not MARKER.search(l)]
    assert not bare, "README lines with a result but no record marker:\n" + "\n".join(f"{n}: {l}" for n, l in bare)


@pytest.mark.parametrize("n,line", [(n, l) for n, l in readme_lines() if MARKER.search(l)])
def test_each_number_is_its_records(n, line):
    """Each value a marker names is printed on its line (to the decimals printed), and the record it comes from was
    written by a command that exited 0."""
    printed = {float(x) for x in NUMBER.findall(MARKER.sub("", line))}
    for path, keys in MARKER.findall(line):
        record = json.loads((ROOT / path).read_text())
        for key in keys.split():
            v = lookup(record, key)
            assert isinstance(v, (int, float)), (key, v)
            assert any(abs(p - v) < 0.05 for p in printed), f"line {n}: {key} = {v} is not on it: {line}"
            entry = lookup(record, key.rsplit(".", 1)[0])
            if "exit_code" in entry: assert entry["exit_code"] == 0, (key, entry["exit_code"])


def test_the_markers_cover_the_next_commands_table():
    "Every row of the README's next-commands table gives a wall time and a result from the record, or says that it has none yet (and how to make it); a row never gives a number of its own."
    text = (ROOT / "README.md").read_text()
    table = text.split("## Next commands", 1)[1].split("\n\n")[2]
    rows = [l for l in table.splitlines() if l.startswith("| `")]
    assert len(rows) >= 8, rows
    for row in rows:
        cells = row.split(" | ")[-2:]
        for cell in cells:
            assert MARKER.search(cell) or cell.strip(" |").startswith("not recorded yet"), row
            if not MARKER.search(cell): assert not NUMBER.search(cell.replace("--only", "")), row


def test_every_command_line_pastes_in_a_fresh_clone():
    """Issue 49 item 2: after `.venv/bin/maxpost` in the main job, bare `maxpost` / `pip` lines failed as pasted
    (`maxpost: command not found`; the venv is never activated). Every command in a README code block, and every
    command cell of the next-commands table, calls the clone's venv: `.venv/bin/<tool>` (the venv's own creation,
    `python3 -m venv .venv`, and shell built-ins aside); an extra is installed as `.venv/bin/pip install -e ".[x]"`."""
    import shlex
    text = (ROOT / "README.md").read_text()
    lines = [l.strip() for l in text.splitlines() if l.startswith("    ") and not l.startswith("     ")]
    lines += [c.strip("`") for l in text.splitlines() if l.startswith("| `") for c in [l.split(" | ")[0][2:]]]
    tools = ("maxpost", "pip", "python", "python3", "papermill", "pytest", "nbdev_export")
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part.split("#")[0].rstrip(" \\"), posix=True) if part.strip() else []
            while words and "=" in words[0] and not words[0].startswith("-"): words = words[1:]   # VAR=value prefix
            if not words or words[0] in ("mkdir", "cd") or words[:3] == ["python3", "-m", "venv"]: continue
            if words[0] in tools or words[0].split("/")[-1] in tools:
                assert words[0].startswith(".venv/bin/"), f"not paste-able in a fresh clone: {line}"
            if words[0].endswith("pip") and "install" in words and any(w.startswith('.[') or w.startswith('".[') for w in words):
                assert "-e" in words, line
    assert 'pip install "maxpost[' not in text, "an extra is installed from the clone: .venv/bin/pip install -e \".[x]\""
