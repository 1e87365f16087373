"""SFT train-step throughput: maxpost's `make_sft_step` vs Tunix's `PeftTrainer` vs TRL's `SFTTrainer` (torch CPU).

Same Qwen3-style shape (bench/common.py SHAPES), random weights, the same random full batch (no padding),
AdamW (lr 1e-5, no weight decay) after global-norm clipping at 1.0, fp32 everywhere. Each framework runs in its own
process with the same thread settings; a step is timed from call to finished update (block_until_ready /
TRL's step callbacks), after warmup steps that include compilation. Reported: median step time, tokens/s,
MFU against the measured JAX fp32 matmul peak (bench/matmul_peak.py, run first in the same driver).

    python bench/sft_throughput.py                  # 20m shape, seq 512, batch 8
    python bench/sft_throughput.py --rounds 3       # all three frameworks three times, interleaved (noisy machines)
    python bench/sft_throughput.py --peers maxpost-remat trl   # also maxpost with remat_policy=full
    python bench/sft_throughput.py --quick          # tiny shape, seq 128, batch 4: a smoke run in ~1 minute
    python bench/sft_throughput.py --worker maxpost --shape 20m --seq 512 --batch 8 --warmup 2 --reps 5
"""
from __future__ import annotations
import argparse, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

LR, CLIP = 1e-5, 1.0


def run_maxpost(a, remat: str = "none") -> dict:
    import dataclasses, jax
    from maxpost.model import num_params
    cfg = dataclasses.replace(common.maxpost_config(a.shape), remat=remat)
    one = common.maxpost_sft_step(cfg, a.batch, a.seq, LR, CLIP)
    t0 = time.perf_counter(); jax.block_until_ready(one()); first = time.perf_counter() - t0
    times, m = common.timed(one, warmup=a.warmup - 1, reps=a.reps, sync=jax.block_until_ready)
    return {"times": times, "first_step_s": first, "loss": float(m["loss"]), "params": num_params(cfg)}


def run_tunix(a) -> dict:
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from tunix.models.qwen3 import model as q3
    from tunix.sft import peft_trainer, utils as sft_utils
    s = common.SHAPES[a.shape]
    cfg = q3.ModelConfig(num_layers=s["num_layers"], vocab_size=s["vocab_size"], embed_dim=s["d_model"],
                         hidden_dim=s["mlp_dim"], num_heads=s["num_heads"], head_dim=s["head_dim"],
                         num_kv_heads=s["num_kv_heads"], rope_theta=int(s["rope_theta"]), norm_eps=s["norm_eps"],
                         use_tied_embedding=True)
    model = q3.Qwen3(cfg, rngs=nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=0.0))
    tcfg = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    trainer = peft_trainer.PeftTrainer(model, tx, tcfg)

    def gen_input(x: peft_trainer.TrainingInput):   # as in Tunix's examples: positions + causal mask from the pad mask
        return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                "positions": sft_utils.build_positions_from_mask(x.input_mask),
                "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask)}
    trainer = trainer.with_gen_model_input_fn(gen_input)
    train_step, _ = trainer.jit_train_and_eval_step()
    b = common.sft_batch(a.batch, a.seq, s["vocab_size"])
    inp = peft_trainer.TrainingInput(input_tokens=jnp.asarray(b["tokens"]), input_mask=jnp.asarray(b["loss_mask"]))
    one = lambda: train_step(inp)
    t0 = time.perf_counter(); jax.block_until_ready(one()); first = time.perf_counter() - t0
    times, out = common.timed(one, warmup=a.warmup - 1, reps=a.reps, sync=jax.block_until_ready)
    return {"times": times, "first_step_s": first, "loss": float(out[0]), "params": int(n)}


def run_trl(a) -> dict:
    import tempfile, torch, numpy as np, datasets, transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import SFTTrainer, SFTConfig
    torch.set_num_threads(common.THREADS); torch.manual_seed(0)
    s = common.SHAPES[a.shape]
    hcfg = Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["d_model"], intermediate_size=s["mlp_dim"],
                       num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                       num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], rope_theta=s["rope_theta"],
                       rms_norm_eps=s["norm_eps"], tie_word_embeddings=True, max_position_embeddings=4096,
                       dtype="float32")
    model = Qwen3ForCausalLM(hcfg)
    n = sum(p.numel() for p in model.parameters())
    tok = common.id_tokenizer(s["vocab_size"])
    steps = a.warmup + a.reps
    b = common.sft_batch(a.batch * steps, a.seq, s["vocab_size"])
    ds = datasets.Dataset.from_dict({"input_ids": b["tokens"].tolist()})

    clock = common.step_clock()
    with tempfile.TemporaryDirectory() as out:
        targs = SFTConfig(output_dir=out, per_device_train_batch_size=a.batch, max_steps=steps, learning_rate=LR,
                          weight_decay=0.0, max_grad_norm=CLIP, lr_scheduler_type="constant", warmup_steps=0,
                          logging_steps=10**6, save_strategy="no", report_to="none", use_cpu=True,
                          max_length=a.seq, packing=False, dataloader_num_workers=0, seed=0,
                          optim="adamw_torch", disable_tqdm=True, bf16=False, fp16=False)
        tr = SFTTrainer(model=model, args=targs, train_dataset=ds, processing_class=tok, callbacks=[clock])
        t0 = time.perf_counter(); res = tr.train(); total = time.perf_counter() - t0
    return {"times": clock.times[a.warmup:], "first_step_s": clock.times[0], "loss": float(res.training_loss),
            "params": int(n), "train_total_s": total}


WORKERS = {"maxpost": run_maxpost, "maxpost-remat": lambda a: run_maxpost(a, "full"), "tunix": run_tunix, "trl": run_trl}


def worker(a) -> None:
    r = WORKERS[a.worker](a)
    med = common.median(r["times"])
    tokens = a.batch * a.seq
    fpt = common.train_flops_per_token(a.shape, a.seq)
    common.emit({"name": a.worker, "shape": a.shape, "seq": a.seq, "batch": a.batch, **r,
                 "median_step_s": med, "tokens_per_s": tokens / med, "gflops": tokens * fpt / med / 1e9})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=list(WORKERS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=list(common.SHAPES))
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--peers", nargs="*", default=["tunix", "trl"])
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all workers (noisy machines)")
    a = ap.parse_args(argv)
    a.shape = a.shape or ("tiny" if a.quick else "20m")
    a.seq = a.seq or (128 if a.quick else 512)
    a.batch = a.batch or (4 if a.quick else 8)
    a.warmup = a.warmup or 2
    a.reps = a.reps or (3 if a.quick else 5)
    if a.worker: worker(a); return 0

    print(f"load average before: {common.load_avg()}; threads {common.THREADS}", flush=True)
    peak = common.run_worker("matmul_peak.py", ["--worker", "--n", "1024", "2048", "--reps", "5"])
    peak_gflops = peak.get("peak_gflops", float("nan"))
    print(f"JAX fp32 matmul peak: {peak_gflops:.1f} GFLOP/s", flush=True)
    args = ["--shape", a.shape, "--seq", str(a.seq), "--batch", str(a.batch), "--warmup", str(a.warmup),
            "--reps", str(a.reps)]
    launch = {name: (lambda name=name: common.run_worker("sft_throughput.py", ["--worker", name, *args],
                                                         extra_path=common.TRL_SITE if name == "trl" else None))
              for name in ["maxpost", *a.peers]}
    per_round = common.run_rounds(launch, a.rounds)
    keys = ["median_step_s", "tokens_per_s", "gflops", "first_step_s", "peak_rss_mb"]
    recs = {name: common.merge_rounds(rs, keys) for name, rs in per_round.items()}
    rows = []
    for name, r in recs.items():
        if "error" in r: rows.append({"name": name, "note": r["error"]}); continue
        ratios = common.paired_ratios(per_round["maxpost"], per_round[name], "tokens_per_s")
        rows.append({"name": name, "params": f"{r['params'] / 1e6:.2f}M", "step": r["median_step_s"],
                     "tps": r["tokens_per_s"], "mfu": f"{100 * r['gflops'] / peak_gflops:.0f}%",
                     "ratio": common.median(ratios), "range": common.spread(ratios), "first": r["first_step_s"],
                     "rss": r["peak_rss_mb"], "load": r["load_avg_after"]})
    common.print_table(f"SFT step, shape {a.shape}, seq {a.seq}, batch {a.batch} (median of {a.reps} steps; "
                       f"{a.rounds} interleaved round(s), medians over rounds)", rows,
                       [("name", "framework"), ("params", "params"), ("step", "step s"), ("tps", "tokens/s"),
                        ("mfu", "MFU vs matmul peak"), ("ratio", "maxpost / this"), ("range", "per-round range"),
                        ("first", "first step s"), ("rss", "peak RSS MiB"), ("load", "load avg after")])
    common.save_results(f"sft_{a.shape}", {"peak": peak, "runs": recs, "rounds": per_round, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
