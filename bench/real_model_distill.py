"""On-policy distillation on a real model: SmolLM2-135M-Instruct after GRPO (the teacher, `real_model.py`'s `full`
stage) distilled into the untrained SmolLM2-135M-Instruct (the student, same vocabulary), on reasoning-gym's
`chain_sum` with `real_model.py`'s task, prompt and evaluation settings; held-out greedy pass@1 of the teacher, the
student before and the student after.

The teacher is `real_model.py`'s `full` stage for `--seed` (60 GRPO steps of 2 prompts x 16 samples, lr 1e-5),
trained into `--out` unless `--teacher` names a finished run. Then one `maxpost distill` (mode on_policy: the student
samples a completion of each prompt at the GRPO run's temperature, the teacher scores every token, the student learns
the per-token reverse KL over the whole vocabulary) from the Hugging Face directory, `DISTILL` below. The teacher is
scored by `maxpost eval` of its last checkpoint and the student by the distillation run, before its first step and
after its last: greedy pass@1 on the same 128 held-out problems as `real_model.py`'s. Every command
runs under GNU `/usr/bin/time -v` and is skipped when its `.time` file exists (a finished earlier run).

FLOPs are counted analytically, as in the README's distillation table: 2N per sampled token, 2N per scoring pass,
6N per trained token, with N the model's parameters (`flops_per_token / 6` of maxpost.timing, attention included),
over the tokens each run logged (prompt and completion; `tokens_per_s` x `timing/step` of every step). GRPO (beta 0,
one update per batch): sampling, the old-policy pass and the update; distillation: sampling, the teacher's pass and
the student's update.

    .venv/bin/python bench/real_model_setup.py                 # the model directory, once
    .venv/bin/python bench/real_model_distill.py                # teacher (~35-50 min) then distillation (~25 min)
    .venv/bin/python bench/real_model_distill.py --teacher maxpost_runs/real_model/grpo-full-s0
    .venv/bin/python bench/real_model_distill.py --quick        # smoke run: 2 steps of a tiny batch
"""
import argparse, importlib.util, json, statistics, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("real_model", ROOT / "bench" / "real_model.py")
rm = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(rm)

# 32 prompts a step, one student sample each, at the GRPO run's sampling temperature; 30 steps (half GRPO's samples)
# at lr 3e-5 (three times GRPO's: the reverse KL is a dense signal; chosen before the run, not tuned) fit ~25 min on
# the shared 2 cores. The teacher's pass@1 is its own `maxpost eval` (as in real_model.json), so the distillation run
# evaluates the student only, before its first step and after its last.
DISTILL = dict(mode="on_policy", steps=30, global_batch_size=32, learning_rate=3e-5, lr_schedule="constant",
               warmup_steps=0, temperature=0.7, distill_temperature=1.0, eval_interval=0, log_period=1,
               eval_teacher=False)
QUICK = dict(steps=2, global_batch_size=4, max_completion_length=16)


def logged_tokens(run: Path, batch: int = 0) -> tuple[float, float]:
    "(prompt + completion tokens, sampled completion tokens or 0 where not logged) over a run's training steps, from its metrics (`tokens_per_s` x `timing/step` per step; log_period=1)."
    steps = [r for r in rm.read_metrics(run) if r.get("kind") == "train"]
    total = sum(r["tokens_per_s"] * r["timing/step"] for r in steps)
    sampled = sum(r.get("completions/mean_length", 0) * batch for r in steps)
    return total, sampled


def n_params(model_path: Path) -> float:
    "N of `flops_per_token` (6N + attention) / 6 for the model at `model_path` (a Hugging Face directory)."
    from maxpost.checkpoint import hf_config_to_model_config
    from maxpost.timing import flops_per_token
    cfg = hf_config_to_model_config(json.loads((Path(model_path) / "config.json").read_text()))
    seq = int(rm.COMMON["max_prompt_length"]) + int(rm.COMMON["max_completion_length"])
    return flops_per_token(cfg, seq) / 6


def distill(teacher: Path, base: Path, seed: int, out: Path, quick: bool, num_prompts: int) -> dict:
    name = f"distill-s{seed}" + ("-quick" if quick else "")
    settings = {**rm.COMMON, **DISTILL, **(QUICK if quick else {}), "load_parameters_path": base,
                "teacher_path": teacher, "seed": seed, "eval_num_prompts": num_prompts,
                "base_output_directory": out, "run_name": name}
    settings["checkpoint_period"] = settings["steps"]
    cost = rm.maxpost("distill", settings, out / f"{name}.time", out / f"{name}.log")
    recs = rm.read_metrics(out / name)
    steps = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    timed = [r["timing/step"] for r in steps[1:]] or [r["timing/step"] for r in steps]
    curve = [{k: r.get(k) for k in ("step", "loss", "reverse_kl", "forward_kl", "top1_agreement")} for r in steps]
    return {"settings": {k: str(v) for k, v in settings.items()}, "train": cost,
            "s_per_step": round(statistics.median(timed), 2), "first_step_s": round(steps[0]["timing/step"], 1),
            "before_pass@1": evals[0]["pass@1"],
            "after_pass@1": evals[-1]["pass@1"], "evals": evals, "curve": curve}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher", type=Path, default=None, help="a finished GRPO run to reuse (default: train one)")
    p.add_argument("--quick", action="store_true", help="2 steps of a tiny batch, 8 eval prompts (smoke run)")
    p.add_argument("--out", type=Path, default=None, help="run directories (default maxpost_runs/real_model_distill)")
    p.add_argument("--record", type=Path, default=None, help="JSON record (default bench/results/real_model_distill.json)")
    a = p.parse_args(argv)
    out, record = rm.run_paths("real_model_distill", a.quick, a.out, a.record)
    num_prompts = rm.QUICK_EVAL_NUM_PROMPTS if a.quick else rm.EVAL_NUM_PROMPTS
    base = rm.model_dir()
    rec = {"model": rm.MODEL, "task": rm.TASK,
           "seed": a.seed, "common": rm.COMMON, "distill": {**DISTILL, **(QUICK if a.quick else {})},
           "eval_num_prompts": num_prompts, "eval_split": "test"}
    if a.teacher is None:
        t = rm.train("full", a.seed, out, base, a.quick, num_prompts)
        teacher = out / f"grpo-full-s{a.seed}"
        rec["teacher"] = {"run": f"grpo-full-s{a.seed}", "settings": t["settings"], "train": t["train"],
                          "s_per_step": t["s_per_step"], "evals_during_run": t["evals_during_run"],
                          "eval": {"metrics": t["after"]["metrics"], "wall_s": t["after"]["wall_s"]}}
    else:
        teacher = a.teacher.resolve()
        ev = rm.evaluate(teacher, teacher.name, out, num_prompts)
        rec["teacher"] = {"run": str(a.teacher), "eval": {"metrics": ev["metrics"], "wall_s": ev["wall_s"]}}
    d = distill(teacher, base, a.seed, out, a.quick, num_prompts)
    rec["run"] = d
    n = n_params(base)
    g_tokens, g_sampled = logged_tokens(teacher, int({**rm.RL, **(rm.QUICK if a.quick else {})}["global_batch_size"]))
    d_tokens, _ = logged_tokens(out / d["settings"]["run_name"])
    rec["flops"] = {"n_params": n, "grpo_tokens": g_tokens, "grpo_sampled_tokens": g_sampled, "distill_tokens": d_tokens,
                    # GRPO at beta 0: the old-policy pass 2N and the update 6N on every token, sampling 2N a sampled one
                    "grpo": n * (8 * g_tokens + 2 * g_sampled),
                    # distillation: sampling (prefill and decode) 2N, the teacher's pass 2N, the update 6N, every token
                    "distill": n * 10 * d_tokens}
    rec["summary"] = {"teacher_pass@1": rec["teacher"]["eval"]["metrics"]["pass@1"],
                      "student_before_pass@1": d["before_pass@1"], "student_after_pass@1": d["after_pass@1"],
                      "teacher_train_wall_s": rec["teacher"].get("train", {}).get("wall_s"),
                      "distill_wall_s": d["train"]["wall_s"], "distill_peak_rss_gb": d["train"]["peak_rss_gb"],
                      "grpo_flops": rec["flops"]["grpo"], "distill_flops": rec["flops"]["distill"]}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(rec, indent=1))
    s = rec["summary"]
    print(f"teacher {100 * s['teacher_pass@1']:.1f} %  student {100 * s['student_before_pass@1']:.1f} % -> "
          f"{100 * s['student_after_pass@1']:.1f} %  distill wall {s['distill_wall_s'] / 60:.1f} min, "
          f"{s['distill_flops']:.2g} FLOPs (GRPO {s['grpo_flops']:.2g})")
    print(f"record: {record}")
    return rec


if __name__ == "__main__":
    main()
