"""Issue 51's bar for RL against a reward model: `maxpost rl` with a `maxpost reward` run as its only reward (no
correctness function) from the main job's default `maxpost sft` checkpoint (the README's 14.8 % one), held-out pass@1
before and after over seeds 0, 1, 2.

    python bench/reward_rl.py probe BASE/RUN [...]    # what a reward model scores: five reply kinds, held-out problems
    python bench/reward_rl.py reward BASE NAME        # train the reward model NAME (REWARD_RUNS) under BASE
    python bench/reward_rl.py pairs BASE              # pairs that differ in correctness, not form: BASE/correct_pairs
    python bench/reward_rl.py run BASE NAME SEED KEY=VALUE ...   # one `maxpost rl` run: BASE/NAME-sSEED.log / .json
    python bench/reward_rl.py validate BASE RUN [RUN ...]        # greedy pass@1 of run directories on test[128:640]
    python bench/reward_rl.py record BASE NAME [NAME ...]        # runs and probes into bench/results/reward_rl.json

BASE holds a copy of the main job's `embedded-sft` run directory and of its `embedded_task` (seed 0 = TASK_SEED, so
`seed=S` varies only the run). `run` calls `maxpost rl seed=S run_name=embedded-NAME-sS base_output_directory=BASE
load_parameters_path=BASE/embedded-sft reward_functions=[] reward_weights=[] KEY=VALUE ...`.

`probe` scores, on the first 256 held-out problems of the embedded task, five replies per problem the way RL scores a
completion (`RewardModelReward`: the gsm8k prompt through the chat template): the worked solution (`worked`), the
same with the last step's result and the answer off by 1 to 3 (`worked_wrong`: wrong but self-consistent), the worked
reasoning with the answer before the last step (`worked_slip`), the answer alone (`answer_only`), and the answer
before the last step alone (`answer_only_slip`, the pairs' rejected reply when it slips)."""
import json, os, random, re, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "reward_rl.json"
KEEP = re.compile(r"^rl embedded-\S+: step \d+/\d+ eval pass@1=|^step=\d+ .*pass@1=|^  (pass@1|pass@4|maj@4) ")
KINDS = ("worked", "worked_wrong", "worked_slip", "answer_only", "answer_only_slip")


def wrong_last_step(answer: str, rng: random.Random) -> str:
    "The answer field with the last step's result (and so the final number) off by 1 to 3, the reasoning consistent with it."
    reasoning, final = answer.rsplit("####", 1)
    y = int(final)
    z = y + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if y + d >= 0])
    i = reasoning.rindex(f"= {y}")
    return f"{reasoning[:i]}= {z}{reasoning[i + len(f'= {y}'):]}#### {z}"


def replies(answer: str, rng: random.Random) -> dict:
    from maxpost.tasks import format_completion, skip_last_step
    slip = skip_last_step(answer)
    return {"worked": format_completion(answer), "worked_wrong": format_completion(wrong_last_step(answer, rng)),
            "worked_slip": format_completion(slip), "answer_only": format_completion(answer, shortcut=True),
            "answer_only_slip": format_completion(slip, shortcut=True)}


def probe(paths: list[str], n: int = 256) -> dict:
    from maxpost.reward import RewardModelReward, load_reward_model, reward_model_tokenizer
    task = Path(paths[0]).parent / "embedded_task"
    rows = [json.loads(l) for l in open(task / "test.jsonl")][:n]
    rng = random.Random("reward_rl-probe")
    reps = [replies(r["answer"], rng) for r in rows]
    out = {}
    for path in paths:
        scorer = RewardModelReward(load_reward_model(path), reward_model_tokenizer(path), batch_size=64,
                                   max_prompt_length=96, max_completion_length=128)
        s = {k: scorer([r["question"] for r in rows], [x[k] for x in reps]) for k in KINDS}
        above = lambda a, b: round(100 * sum(x > y for x, y in zip(s[a], s[b])) / len(rows), 1)
        out[Path(path).name] = {
            "n_problems": len(rows), "mean_score": {k: round(statistics.mean(v), 3) for k, v in s.items()},
            "percent_of_problems_scored_higher": {
                "worked over worked_wrong": above("worked", "worked_wrong"),
                "worked over worked_slip": above("worked", "worked_slip"),
                "answer_only over answer_only_slip": above("answer_only", "answer_only_slip"),
                "answer_only over worked_wrong": above("answer_only", "worked_wrong"),
                "answer_only over worked_slip": above("answer_only", "worked_slip"),
                "worked over answer_only": above("worked", "answer_only")}}
        print(json.dumps({Path(path).name: out[Path(path).name]}, indent=1), flush=True)
    return out


def correct_pairs(base: Path) -> Path:
    """BASE/correct_pairs/{train,test}.jsonl: the embedded task's problems as pairs whose replies have the same form and
    differ in correctness, a fifth of each kind: worked over worked_wrong, worked over worked_slip, answer_only over
    answer_only_slip, and across forms answer_only over worked_wrong and worked over answer_only_slip, so that a worked
    reply is chosen and rejected equally often (3 in 5) and form alone predicts nothing."""
    from maxpost.tasks import prompt_messages
    out = base / "correct_pairs"; out.mkdir(exist_ok=True)
    kinds = [("worked", "worked_wrong"), ("worked", "worked_slip"), ("answer_only", "answer_only_slip"),
             ("answer_only", "worked_wrong"), ("worked", "answer_only_slip")]
    for split in ("train", "test"):
        rng = random.Random(f"reward_rl-pairs/{split}")
        with open(base / "embedded_task" / f"{split}.jsonl") as f, open(out / f"{split}.jsonl", "w") as g:
            for row in map(json.loads, f):
                rep, (c, r) = replies(row["answer"], rng), rng.choice(kinds)
                g.write(json.dumps({"prompt": prompt_messages(row["question"]),
                                    "chosen": [{"role": "assistant", "content": rep[c]}],
                                    "rejected": [{"role": "assistant", "content": rep[r]}], "kind": f"{c}>{r}"}) + "\n")
    return out


def run(base: Path, name: str, seed: int, keys: list[str]):
    run_name = f"{name}-s{seed}"
    args = ["rl", f"seed={seed}", f"run_name=embedded-{run_name}", f"base_output_directory={base}",
            f"load_parameters_path={base}/embedded-sft", "reward_functions=[]",
            *([] if any(k.startswith("reward_weights=") for k in keys) else ["reward_weights=[]"]), *keys]
    exe = Path(sys.executable).parent / "maxpost"
    info = {"command": "maxpost " + " ".join(args), "load_average_start": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.time()
    with open(base / f"{run_name}.log", "w") as log:
        rc = subprocess.call([str(exe), *args], stdout=log, stderr=subprocess.STDOUT)
    info.update(exit_code=rc, wall_min=round((time.time() - t0) / 60, 1),
                load_average_end=[round(x, 2) for x in os.getloadavg()])
    (base / f"{run_name}.json").write_text(json.dumps(info, indent=1) + "\n")
    print(run_name, "exit", rc, "wall", info["wall_min"], "min", flush=True)


VALIDATION = "test[128:640]"   # 512 held-out problems that no run here was evaluated on while it was chosen


def validate(base: Path, runs: list[str]):
    "`maxpost eval` (greedy) of each run directory under `base` on the VALIDATION problems, into BASE/val-RUN/eval.json."
    for run in runs:
        args = ["eval", f"load_parameters_path={base / run}", f"run_name=val-{run}", f"base_output_directory={base}",
                f"eval_split={VALIDATION}", "eval_num_prompts=0", "eval_k=0"]
        with open(base / f"val-{run}.log", "w") as log:
            rc = subprocess.call([str(Path(sys.executable).parent / "maxpost"), *args], stdout=log, stderr=subprocess.STDOUT)
        print(run, "exit", rc, flush=True)


def validation(base: Path, run: str) -> float | None:
    p = base / f"val-{run}" / "eval.json"
    return round(100 * json.loads(p.read_text())["metrics"]["pass@1"], 1) if p.exists() else None


def parse(base: Path, run_name: str) -> dict:
    printed = [l for l in (base / f"{run_name}.log").read_text().splitlines() if KEEP.search(l)]
    got = {k: re.search(rf"^  {k} +([\d.]+) % -> +([\d.]+) %", "\n".join(printed), re.M) for k in ("pass@1", "pass@4")}
    out = {f"{k}_{w}": float(m[i]) for k, m in got.items() if m for i, w in ((1, "before"), (2, "after"))}
    last = [json.loads(l) for l in open(base / f"embedded-{run_name}" / "metrics.jsonl")]
    ev = [d for d in last if "mean_completion_length" in d]
    if ev: out["completion_length_before_after"] = [round(ev[0]["mean_completion_length"], 1), round(ev[-1]["mean_completion_length"], 1)]
    if (v := validation(base, f"embedded-{run_name}")) is not None: out["validation_pass@1_after"] = v
    info = json.loads((base / f"{run_name}.json").read_text())
    return {**info, "command": info["command"].replace(str(base), "BASE"), **out, "printed": printed}


def summary(per_seed: dict) -> dict:
    "Over the seeds: pass@1 after (mean, sample sd), the gain over the SFT checkpoint and whether it exceeds 2 sd."
    seeds = sorted(per_seed)
    before = [per_seed[s]["pass@1_before"] for s in seeds]
    after = [per_seed[s]["pass@1_after"] for s in seeds]
    gain = [a - b for a, b in zip(after, before)]
    sd = statistics.stdev(after) if len(after) > 1 else None
    return {"seeds": [int(s) for s in seeds], "n_seeds": len(seeds), "exit_code": max(per_seed[s]["exit_code"] for s in seeds),
            "pass@1_before": before[0] if len(set(before)) == 1 else None,
            "pass@1_after_per_seed": after, "pass@1_after": round(statistics.mean(after), 1),
            "pass@1_after_sd": None if sd is None else round(sd, 1), "gain_mean": round(statistics.mean(gain), 1),
            "gain_over_2sd": None if sd is None else statistics.mean(gain) > 2 * sd,
            "pass@4_after_per_seed": [per_seed[s].get("pass@4_after") for s in seeds],
            "completion_length_after_per_seed": [per_seed[s].get("completion_length_before_after", [None, None])[1] for s in seeds],
            "validation_pass@1_after_per_seed": [per_seed[s].get("validation_pass@1_after") for s in seeds],
            "wall_min_per_seed": [per_seed[s]["wall_min"] for s in seeds],
            "wall_min": round(statistics.mean(per_seed[s]["wall_min"] for s in seeds), 1)}


REWARD_RUNS = {   # the reward models `reward` trains: run name -> the keys after `maxpost reward` (BASE: the base directory)
    "embedded-reward": ["save_hf=true", "base_output_directory=BASE"],
    "embedded-reward-correct": ["run_name=embedded-reward-correct", "dataset_name=BASE/correct_pairs",
                                "load_parameters_path=BASE/embedded-sft", "steps=200", "base_output_directory=BASE",
                                "save_hf=true"]}


def reward(base: Path, name: str):
    "Train the reward model `name` of REWARD_RUNS under `base`; its output and exit code in BASE/NAME.log."
    args = ["reward", *(k.replace("BASE", str(base)) for k in REWARD_RUNS[name])]
    with open(base / f"{name}.log", "w") as log:
        rc = subprocess.call([str(Path(sys.executable).parent / "maxpost"), *args], stdout=log, stderr=subprocess.STDOUT)
        print(f"exit {rc}", file=log)
    print(name, "exit", rc, flush=True)


def reward_run(base: Path, name: str) -> dict:
    "A reward model's run: its command, held-out pair accuracy and margin before and after (metrics.jsonl), its wall time from its timing.json (first step, then steps x the mean step)."
    command, log = "maxpost reward " + " ".join(REWARD_RUNS[name]), f"{name}.log"
    ev = [d for d in map(json.loads, open(base / name / "metrics.jsonl")) if d.get("kind") == "eval"]
    t = json.loads((base / name / "timing.json").read_text())
    lines = (base / log).read_text().splitlines()
    return {"command": command, "exit_code": int(lines[-1].split()[-1]) if lines[-1].startswith("exit") else None,
            "eval_accuracy_before": round(100 * ev[0]["eval_accuracy"], 1), "eval_accuracy": round(100 * ev[-1]["eval_accuracy"], 1),
            "eval_margin": round(ev[-1]["eval_margin"], 2), "held_out_pairs": 256,
            "wall_min": round((t["first_step"]["total"] + t["steps_timed"] * t["steps"]["timing/step"]) / 60, 1),
            "printed": [l for l in lines if l.startswith("held-out pair accuracy")]}


ABOUT = ("Issue 51: `maxpost rl` with a reward model as its only reward (reward_functions=[]), from the main job's default "
         "`maxpost sft` checkpoint (the README's 14.8 % one) and its embedded task, run by bench/reward_rl.py one run at a "
         "time under nice -n 10 on the project's 2-core CPU shared with other jobs (load averages per run). pass@1: "
         "held-out greedy accuracy in % of 128 problems; pass@4 from 4 samples at temperature 1. `summary`: over the "
         "seeds run, the mean and sample sd of pass@1 after, and whether the mean gain exceeds 2 sd. `probe`: the mean "
         "score each reward model gives five reply kinds on 256 held-out problems, and how often one kind outscores "
         "another on the same problem (bench/reward_rl.py's docstring).")


UNBALANCED = ("A first try at correctness pairs, 100 steps, from four kinds of pair (this script's without worked over "
              "answer_only_slip): the one pair across forms always chose the answer alone, so the model learned form "
              "again, the other way round (held-out pair accuracy 68.4 %; its run was discarded, its probe kept).")


def record(base: Path, names: list[str]):
    rec = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    rec["about"] = ABOUT
    if (v := validation(base, "embedded-sft")) is not None:
        rec["validation"] = {"eval_split": VALIDATION, "what": "greedy pass@1 in % of these 512 held-out problems (`validate`), "
                             "apart from the 128 the runs evaluated and the recipes were chosen on", "sft_pass@1": v}
    for name in REWARD_RUNS:
        if (base / name / "timing.json").exists(): rec.setdefault("reward_models", {})[name] = reward_run(base, name)
    for name in names:
        per_seed = {p.stem.rsplit("-s", 1)[1]: parse(base, p.stem) for p in sorted(base.glob(f"{name}-s*.json"))}
        rec.setdefault("runs", {})[name] = {"command": per_seed[min(per_seed)]["command"].replace(f"seed={min(per_seed)}", "seed=S").replace(f"-s{min(per_seed)} ", "-sS "),
                                            "per_seed": per_seed, "summary": summary(per_seed)}
        print(name, json.dumps(rec["runs"][name]["summary"]))
    if (base / "probe.json").exists(): rec["probe"] = json.loads((base / "probe.json").read_text())
    if "embedded-reward-correct-unbalanced" in rec.get("probe", {}):
        rec["probe"]["embedded-reward-correct-unbalanced"]["note"] = UNBALANCED
    RECORD.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "probe":
        got = probe(rest)
        p = Path(rest[0]).parent / "probe.json"
        p.write_text(json.dumps((json.loads(p.read_text()) if p.exists() else {}) | got, indent=1) + "\n")
    elif cmd == "reward": reward(Path(rest[0]).resolve(), rest[1])
    elif cmd == "validate": validate(Path(rest[0]).resolve(), rest[1:])
    elif cmd == "pairs": print(correct_pairs(Path(rest[0]).resolve()))
    elif cmd == "run": run(Path(rest[0]).resolve(), rest[1], int(rest[2]), rest[3:])
    else: record(Path(rest[0]).resolve(), rest[1:])
