"""The README's commands as a newcomer pastes them, one after the other in one fresh directory, each timed, its held-out
pass@1 read from what it prints: the record that README.md's "Next commands" table quotes (tests/test_readme_numbers.py
checks every number there against it).

    .venv/bin/python bench/readme_commands.py --out bench/results/readme_commands.json [--only sft rl dpo ...]

Each command is the README's line exactly as written (`.venv/bin/maxpost ...`), run by bash in --workdir: give a fresh
clone whose `.venv` the README's install line built, as a newcomer has (the SmolLM2 lines and papermill's read the
clone's bench/, configs/ and nbs/). Without --workdir the maxpost commands run in a new temporary directory, so
`maxpost_runs/` starts empty as in a fresh clone, with `.venv` there a link to this interpreter's environment and this
checkout first on PYTHONPATH. The record is read again and rewritten after every command (two of these scripts may
fill one record at once), with the host's core count and load average at each command's start and end (the wall
times depend on them)."""
from __future__ import annotations
import argparse, json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {   # name -> the line exactly as README.md gives it, in README order
    "sft": ".venv/bin/maxpost sft",
    "rl": ".venv/bin/maxpost rl",
    "eval": ".venv/bin/maxpost eval",
    "gspo": ".venv/bin/maxpost rl loss_algo=gspo",
    "cispo": ".venv/bin/maxpost rl loss_algo=cispo",
    "rloo": ".venv/bin/maxpost rl advantage_estimator=rloo run_name=embedded-rloo",
    "dpo": ".venv/bin/maxpost dpo",
    "kto": ".venv/bin/maxpost dpo loss_type=kto",
    "reward": ".venv/bin/maxpost reward save_hf=true",
    "reward_rl": ".venv/bin/maxpost rl 'reward_functions=[]' 'reward_weights=[]' 'reward_models=[maxpost_runs/embedded-reward]' "
                 "beta=0.04 learning_rate=3e-5 eval_interval=20 run_name=embedded-grpo-rm",
    "distill": ".venv/bin/maxpost distill",
    "lora": ".venv/bin/maxpost rl lora_rank=8 learning_rate=3e-4 run_name=embedded-grpo-lora8",
    "calculator_sft": ".venv/bin/maxpost sft embedded_task=calculator run_name=calc-sft",
    "calculator_rl": ".venv/bin/maxpost rl embedded_task=calculator environment=calculator "
                     "load_parameters_path=maxpost_runs/calc-sft run_name=calc-grpo",
    "smollm2_setup": '.venv/bin/pip install -e ".[gguf,reasoning-gym]" && .venv/bin/python bench/real_model_setup.py',
    "smollm2_first_look": ".venv/bin/maxpost rl configs/recipes/smollm2_chain_sum.yml steps=5 run_name=smollm2-first-look",
    "papermill": "mkdir -p out && .venv/bin/papermill nbs/runs/sft.ipynb out/sft.ipynb -p run_name exp1 -p steps 200",
}
PAIRS = re.compile(r"held-out pair accuracy ([\d.]+)% at step \d+ -> ([\d.]+)%")
AFTER_SFT = re.compile(r"held-out \((\d+) problems\) after SFT: pass@1 ([\d.]+) %")
BEFORE_AFTER = re.compile(r"pass@1\s+([\d.]+) %\s+->\s+([\d.]+) %")
SINGLE = re.compile(r"pass@1\s+([\d.]+) %")
TEACHER = re.compile(r"teacher: pass@1 ([\d.]+) %")
EVAL_JSON = Path("maxpost_runs") / "eval-embedded-sft" / "eval.json"   # where the bare `maxpost eval` writes


def host() -> dict:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def parse(text: str) -> dict:
    "The held-out pass@1 a command printed: after SFT, or before -> after (RL, DPO, distill), or one value (eval); a reward model's held-out pair accuracy."
    if m := PAIRS.search(text): return {"eval_accuracy_before": float(m.group(1)), "eval_accuracy": float(m.group(2))}
    if m := AFTER_SFT.search(text): return {"pass@1": float(m.group(2)), "problems": int(m.group(1))}
    if found := BEFORE_AFTER.findall(text):
        before, after = found[-1]
        teacher = {"teacher_pass@1": float(m.group(1))} if (m := TEACHER.search(text)) else {}
        return {"pass@1_before": float(before), "pass@1_after": float(after), **teacher}
    if found := SINGLE.findall(text): return {"pass@1": float(found[-1])}
    return {}


def run(name: str, workdir: Path) -> dict:
    line = COMMANDS[name]
    env = dict(os.environ)
    if workdir.resolve() != ROOT: env["PYTHONPATH"] = str(ROOT)   # not the clone itself: this checkout's package
    start, t0 = host(), time.time()
    r = subprocess.run(["bash", "-c", line], cwd=workdir, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    text = r.stdout + r.stderr
    lines = [l for l in text.splitlines() if "pass@1" in l or "pair accuracy" in l or "teacher" in l and "%" in l]
    found = parse(text)
    if line.split()[:2] == [".venv/bin/maxpost", "eval"] and r.returncode == 0:   # its summary is a table: the number is in the eval.json it wrote
        found = {"pass@1": round(100 * json.loads((workdir / EVAL_JSON).read_text())["metrics"]["pass@1"], 1)}
    tail = {} if r.returncode == 0 else {"output_tail": text.splitlines()[-15:]}
    return {"command": line, "exit_code": r.returncode, "wall_s": round(wall, 1),
            "wall_min": round(wall / 60, 1), "host_at_start": start, "host_at_end": host(), **found,
            "printed": lines[-6:], **tail}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "readme_commands.json"))
    p.add_argument("--only", nargs="*", choices=list(COMMANDS), help="these commands, in README order")
    p.add_argument("--workdir", help="run here (default: a fresh temporary directory)")
    a = p.parse_args()
    out = Path(a.out)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="maxpost-readme-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / ".venv").exists(): (work / ".venv").symlink_to(sys.prefix)   # not a clone: this environment's
    for name in [n for n in COMMANDS if not a.only or n in a.only]:
        res = run(name, work)
        record = json.loads(out.read_text()) if out.exists() else {"commands": {}}   # read again: another may have written
        record["commands"][name] = res
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: exit {res['exit_code']}, {res['wall_min']} min, {parse(' '.join(res['printed']))}", flush=True)
        if res["exit_code"] != 0: return res["exit_code"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
