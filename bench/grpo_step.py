"""Wall time of one GRPO step (rollout + reference log-probs + policy update): maxpost vs TRL's GRPOTrainer vs
Tunix's GRPOLearner.

Same Qwen3-style shape, random weights, P prompts x G generations (default 8 x 4 = 32 completions), prompt length
32, exactly T completion tokens (EOS disabled / never reachable), temperature 1, beta 0.04 (so a reference model's
log-probs are computed), one iteration (mu = 1), one optimizer update per step (AdamW, lr 1e-6, clip 1.0), the same
cheap Python reward. maxpost's step is timed around `generate` + rewards + advantages + reference log-probs +
`make_rl_step`; TRL's and Tunix's between consecutive steps of their own `train()` loop (callbacks / the moment
the learner pulls the next batch), after warmup steps that include compilation.

    python bench/grpo_step.py                     # tiny and 20m shapes, T 64
    python bench/grpo_step.py --quick             # tiny shape, T 16
    python bench/grpo_step.py --shapes 20m --rounds 3   # every framework three times, interleaved (noisy machines)
    python bench/grpo_step.py --worker maxpost --shape tiny --new 64 --warmup 2 --reps 3
"""
from __future__ import annotations
import argparse, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

LR, CLIP, BETA, EPS = 1e-6, 1.0, 0.04, 0.2


def reward_even(prompts, completions, **kw) -> list[float]:
    "A cheap reward every framework can call: the share of even token ids in the completion text."
    out = []
    for c in completions:
        toks = str(c).split()
        out.append(sum(t.isdigit() and int(t) % 2 == 0 for t in toks) / max(len(toks), 1))
    return out


def run_maxpost(a, prompts) -> dict:
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from maxpost.model import create_model
    from maxpost.sampling import generate
    from maxpost.advantages import group_advantages
    from maxpost.rl import make_rl_step
    from maxpost.sampling import make_logps_fn
    cfg = common.maxpost_config(a.shape)
    model = create_model(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_params = jax.tree.map(jnp.copy, params)
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=0.0))
    opt_state = tx.init(params)
    loss_kwargs = dict(loss_algo="grpo", epsilon_low=EPS, epsilon_high=EPS, beta=BETA, kl_estimator="k3",
                       loss_agg_mode="token-mean")
    # as RLTrainer does with the whole batch as one mini-batch: each group's prompt runs once
    step_fn, logps_fn = make_rl_step(graphdef, tx, loss_kwargs, 1.0, a.G), make_logps_fn(graphdef, 1.0, a.G)
    st = {"p": params, "o": opt_state, "i": 0}
    tok = common.id_tokenizer(cfg.vocab_size, bos=False)
    phases = []

    def one():
        t0 = time.perf_counter()
        r = generate(nnx.merge(graphdef, st["p"], rest), prompts, max_prompt_length=a.prompt,
                     max_completion_length=a.new, num_generations=a.G, temperature=1.0, eos_ids=(), seed=st["i"],
                     tokenizer=tok)
        t1 = time.perf_counter()
        rewards = np.asarray(reward_even([p for p in prompts for _ in range(a.G)], r.text), np.float32)
        adv = np.asarray(group_advantages(jnp.asarray(rewards), a.G))
        b = dict(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask, completion_ids=r.completion_ids,
                 completion_mask=r.completion_mask, advantages=adv)
        b["ref_per_token_logps"] = logps_fn(ref_params, rest, b)
        jax.block_until_ready(b["ref_per_token_logps"]); t2 = time.perf_counter()
        st["p"], st["o"], m = step_fn(st["p"], rest, st["o"], b)
        loss = float(m["loss"]); t3 = time.perf_counter()
        st["i"] += 1
        phases.append({"rollout_s": t1 - t0, "ref_logps_s": t2 - t1, "update_s": t3 - t2})
        return loss
    t0 = time.perf_counter(); one(); first = time.perf_counter() - t0
    times, loss = common.timed(one, warmup=a.warmup - 1, reps=a.reps)
    timed_phases = phases[-a.reps:]
    return {"times": times, "first_step_s": first, "loss": loss,
            "phases": {k: common.median([p[k] for p in timed_phases]) for k in timed_phases[0]}}


def run_trl(a, prompts) -> dict:
    import tempfile, torch, datasets
    from trl import GRPOTrainer, GRPOConfig
    from rollout import vllm_model_dir
    torch.set_num_threads(common.THREADS); torch.manual_seed(0)
    model = str(vllm_model_dir(a.shape))   # TRL builds its reference model from the policy's path
    tok = common.id_tokenizer(common.SHAPES[a.shape]["vocab_size"], bos=False)
    tok.padding_side = "left"
    steps = a.warmup + a.reps
    ds = datasets.Dataset.from_dict({"prompt": [common.ids_to_text(p) for p in prompts] * steps})

    clock = common.step_clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=len(prompts) * a.G, num_generations=a.G,
                         max_completion_length=a.new, temperature=1.0, top_p=1.0, top_k=0, beta=BETA,
                         num_iterations=1, epsilon=EPS, learning_rate=LR, max_grad_norm=CLIP, weight_decay=0.0,
                         lr_scheduler_type="constant", max_steps=steps, logging_steps=10**6, save_strategy="no",
                         report_to="none", use_cpu=True, bf16=False, fp16=False, disable_tqdm=True, seed=0,
                         generation_kwargs={"min_new_tokens": a.new}, shuffle_dataset=False,
                         gradient_accumulation_steps=1, loss_type="grpo", log_completions=False)
        tr = GRPOTrainer(model=model, reward_funcs=reward_even, args=cfg, train_dataset=ds, processing_class=tok,
                         callbacks=[clock])
        tr.train()
    return {"times": clock.times[a.warmup:], "first_step_s": clock.times[0]}


def run_tunix(a, prompts) -> dict:
    import jax, numpy as np, optax
    from flax import nnx
    from tunix.models.qwen3 import model as q3
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.rollout import base_rollout
    from tunix.rl.grpo import grpo_learner
    from rollout import tunix_config
    cfg = tunix_config(a.shape)
    actor, ref = q3.Qwen3(cfg, rngs=nnx.Rngs(0)), q3.Qwen3(cfg, rngs=nnx.Rngs(0))
    tok = common.PlainTokenizer(cfg.vocab_size)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # explicit axes break Tunix 0.1.7
    steps = a.warmup + a.reps
    tcfg = rlc.RLTrainingConfig(actor_optimizer=optax.chain(optax.clip_by_global_norm(CLIP),
                                                            optax.adamw(LR, weight_decay=0.0)),
                                eval_every_n_steps=10**9, max_steps=steps, pbar_description=None)
    rcfg = base_rollout.RolloutConfig(max_tokens_to_generate=a.new, max_prompt_length=a.prompt, temperature=1.0,
                                      top_p=1.0, kv_cache_size=1024, eos_tokens=[-1])  # Tunix pads prompts past P
    cluster = rlc.RLCluster(actor=actor, reference=ref, tokenizer=tok, cluster_config=rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, training_config=tcfg, rollout_config=rcfg))
    gcfg = grpo_learner.GRPOConfig(num_generations=a.G, num_iterations=1, beta=BETA, epsilon=EPS,
                                   loss_agg_mode="token-mean")
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=gcfg, reward_fns=[reward_even])
    texts = [common.ids_to_text(p) for p in prompts]
    pulls = []
    def data():
        for _ in range(steps + 2):
            pulls.append(time.perf_counter())
            yield {"prompts": list(texts)}
    t0 = time.perf_counter()
    learner.train(data())
    end = time.perf_counter()
    marks = pulls[:steps] + [end]  # the learner may pull one batch ahead: intervals between pulls are step times
    d = np.diff([t0] + marks[1:steps + 1]).tolist()
    return {"times": d[a.warmup:], "first_step_s": d[0], "pull_intervals": d}


WORKERS = {"maxpost": run_maxpost, "trl": run_trl, "tunix": run_tunix}


def worker(a) -> None:
    prompts = common.prompt_ids(a.prompts, a.prompt, common.SHAPES[a.shape]["vocab_size"], seed=2)
    r = WORKERS[a.worker](a, prompts)
    med = common.median(r["times"])
    common.emit({"name": a.worker, "shape": a.shape, "prompts": a.prompts, "G": a.G, "prompt": a.prompt,
                 "new": a.new, **r, "median_step_s": med})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=list(common.SHAPES))
    ap.add_argument("--shapes", nargs="*")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--peers", nargs="*", default=["trl", "tunix"])
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all workers (noisy machines)")
    a = ap.parse_args(argv)
    a.new = a.new or (16 if a.quick else 64)
    a.reps = a.reps or (2 if a.quick else 3)
    if a.worker: worker(a); return 0

    shapes = a.shapes or (["tiny"] if a.quick else ["tiny", "20m"])
    print(f"load average before: {common.load_avg()}; threads {common.THREADS}", flush=True)
    rows, recs = [], {}
    for shape in shapes:
        base = ["--shape", shape, "--prompts", str(a.prompts), "--G", str(a.G), "--prompt", str(a.prompt),
                "--new", str(a.new), "--warmup", str(a.warmup), "--reps", str(a.reps)]
        launch = {name: (lambda name=name: common.run_worker("grpo_step.py", ["--worker", name, *base], timeout=1500,
                                                             extra_path=common.TRL_SITE if name == "trl" else None))
                  for name in ["maxpost", *a.peers]}
        per_round = common.run_rounds(launch, a.rounds)
        res = {name: common.merge_rounds(rs, ["median_step_s", "first_step_s", "peak_rss_mb"])
               for name, rs in per_round.items()}
        recs[shape] = {"merged": res, "rounds": per_round}
        for name, r in res.items():
            if "error" in r: rows.append({"shape": shape, "name": name, "note": r["error"]}); continue
            ratios = common.paired_ratios(per_round["maxpost"], per_round[name], "median_step_s")
            ok = [x["phases"] for x in per_round[name] if "phases" in x]   # maxpost's phases, medians over rounds
            ph = {k: common.median([x[k] for x in ok]) for k in (ok[0] if ok else {})}
            rows.append({"shape": shape, "name": name, "s": r["median_step_s"], "ratio": common.median(ratios),
                         "range": common.spread(ratios), "first": r["first_step_s"], "rss": r["peak_rss_mb"],
                         "load": r["load_avg_after"], "note": ", ".join(f"{k} {v:.2f}" for k, v in ph.items())})
    common.print_table(f"GRPO step: {a.prompts} prompts x G={a.G}, prompt {a.prompt}, {a.new} new tokens, beta {BETA} "
                       f"(median of {a.reps} steps; {a.rounds} interleaved round(s), medians over rounds)", rows,
                       [("shape", "shape"), ("name", "framework"), ("s", "step s"), ("ratio", "maxpost / this"),
                        ("range", "per-round range"), ("first", "first step s"), ("rss", "peak RSS MiB"),
                        ("load", "load avg after"), ("note", "phases (s)")])
    common.save_results("grpo_quick" if a.quick else "grpo_" + "_".join(shapes), {"runs": recs, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
