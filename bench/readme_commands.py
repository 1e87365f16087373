"""The README's commands as a newcomer pastes them, one after the other in one fresh directory, each timed, its held-out
pass@1 read from what it prints: the record that README.md's "Next commands" table quotes (tests/test_readme_numbers.py
checks every number there against it).

    .venv/bin/python bench/readme_commands.py --out bench/results/readme_commands.json [--only sft rl dpo ...]

Each command runs as `maxpost ...` of this checkout (`python -m maxpost.cli`) in a temporary directory (or --workdir),
so `maxpost_runs/` starts empty as in a fresh clone. The record is rewritten after every command, with the host's
core count and load average at each command's start and end (the wall times depend on them)."""
from __future__ import annotations
import argparse, json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {   # name -> the arguments after `maxpost`, exactly as README.md gives them, in README order
    "sft": ["sft"],
    "rl": ["rl"],
    "eval": ["eval"],
    "gspo": ["rl", "loss_algo=gspo"],
    "dpo": ["dpo"],
    "distill": ["distill"],
    "lora": ["rl", "lora_rank=8", "learning_rate=3e-4", "run_name=embedded-grpo-lora8"],
    "calculator_sft": ["sft", "embedded_task=calculator", "run_name=calc-sft"],
    "calculator_rl": ["rl", "embedded_task=calculator", "environment=calculator",
                      "load_parameters_path=maxpost_runs/calc-sft", "run_name=calc-grpo"],
}
AFTER_SFT = re.compile(r"held-out \((\d+) problems\) after SFT: pass@1 ([\d.]+) %")
BEFORE_AFTER = re.compile(r"pass@1\s+([\d.]+) %\s+->\s+([\d.]+) %")
SINGLE = re.compile(r"pass@1\s+([\d.]+) %")
TEACHER = re.compile(r"teacher: pass@1 ([\d.]+) %")
EVAL_JSON = Path("maxpost_runs") / "eval-embedded-sft" / "eval.json"   # where the bare `maxpost eval` writes


def host() -> dict:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def parse(text: str) -> dict:
    "The held-out pass@1 a command printed: after SFT, or before -> after (RL, DPO, distill), or one value (eval)."
    if m := AFTER_SFT.search(text): return {"pass@1": float(m.group(2)), "problems": int(m.group(1))}
    if found := BEFORE_AFTER.findall(text):
        before, after = found[-1]
        teacher = {"teacher_pass@1": float(m.group(1))} if (m := TEACHER.search(text)) else {}
        return {"pass@1_before": float(before), "pass@1_after": float(after), **teacher}
    if found := SINGLE.findall(text): return {"pass@1": float(found[-1])}
    return {}


def run(name: str, workdir: Path) -> dict:
    argv = COMMANDS[name]
    start, t0 = host(), time.time()
    r = subprocess.run([sys.executable, "-m", "maxpost.cli", *argv], cwd=workdir, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.time() - t0
    text = r.stdout + r.stderr
    lines = [l for l in text.splitlines() if "pass@1" in l or "teacher" in l and "%" in l]
    found = parse(text)
    if argv[0] == "eval" and r.returncode == 0:   # its summary is a table: the number is in the eval.json it wrote
        found = {"pass@1": round(100 * json.loads((workdir / EVAL_JSON).read_text())["metrics"]["pass@1"], 1)}
    return {"command": "maxpost " + " ".join(argv), "exit_code": r.returncode, "wall_s": round(wall, 1),
            "wall_min": round(wall / 60, 1), "host_at_start": start, "host_at_end": host(), **found,
            "printed": lines[-6:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "readme_commands.json"))
    p.add_argument("--only", nargs="*", choices=list(COMMANDS), help="these commands, in README order")
    p.add_argument("--workdir", help="run here (default: a fresh temporary directory)")
    a = p.parse_args()
    out = Path(a.out)
    record = json.loads(out.read_text()) if out.exists() else {"commands": {}}
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="maxpost-readme-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in [n for n in COMMANDS if not a.only or n in a.only]:
        record["commands"][name] = res = run(name, work)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: exit {res['exit_code']}, {res['wall_min']} min, {parse(' '.join(res['printed']))}", flush=True)
        if res["exit_code"] != 0: return res["exit_code"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
