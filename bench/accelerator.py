"""The 1B-parameter rows on an accelerator: SFT step and rollout of a bf16 preset, MFU against the chip's bf16 peak.

One process, one script (a GPU lease here is a few minutes, compile included): JAX's bf16 matmul peak measured on the
chip, one SFT train step (`make_sft_step`: fp32 parameters and AdamW state, bf16 compute, global-norm clipping,
random full batch), then `generate` with bf16 weights at each batch size (P prompt tokens, T new tokens, temperature
1, EOS disabled), and with `--hf` transformers' `generate` on the same chip in bf16 (torch, sdpa attention) as the
peer. MFU of the SFT step is given against both the spec peak (`maxpost.timing.PEAK_BF16_FLOPS`) and the measured
matmul peak; for decoding, which reads every weight once a step, the table gives the fraction of the chip's memory
bandwidth that the bf16 weights alone would take (`--hbm-tbs`).

Prints markdown tables and writes `bench/results/accelerator_<preset>.json` (a copy under $OUT when it is set).

    python bench/accelerator.py --hf                           # llama3.2-1b: SFT seq 1024 x batch 8, rollout P 32 T 128
    python bench/accelerator.py --preset qwen3-1.7b --seq 2048 --batch 4
    python bench/accelerator.py --quick --hf                   # tiny preset on CPU: the same code paths in ~1 minute
"""
from __future__ import annotations
import argparse, dataclasses, json, os, shutil, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave room for torch's peer afterwards
LR, CLIP = 1e-5, 1.0


def sync(x):
    import jax
    return jax.block_until_ready(x)


def matmul_peak(n: int, reps: int) -> float:
    "bf16 `x @ y` FLOP/s at n x n x n: the median of the timed products (random data)."
    import jax, jax.numpy as jnp
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), jnp.bfloat16); y = jax.random.normal(ky, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    times, _ = common.timed(lambda: f(x, y), warmup=3, reps=reps, sync=sync)
    return 2 * n**3 / common.median(times)


def sft_row(mcfg, a) -> dict:
    from maxpost.model import num_params
    from maxpost.timing import flops_per_token, device_peak_flops
    one = common.maxpost_sft_step(mcfg, a.batch, a.seq, LR, CLIP)
    t0 = time.perf_counter(); sync(one()); first = time.perf_counter() - t0
    times, m = common.timed(one, warmup=1, reps=a.reps, sync=sync)
    s = common.median(times); tok = a.batch * a.seq
    flops = flops_per_token(mcfg, a.seq) * tok / s
    spec = device_peak_flops()
    return {"what": "maxpost SFT step", "params": num_params(mcfg), "seq": a.seq, "batch": a.batch, "step_s": s,
            "times": times, "first_s": first, "tokens_per_s": tok / s, "model_tflops": flops / 1e12,
            "mfu_spec": flops / spec if spec else None, "loss": float(m["loss"]),
            "device_mem_gb": device_mem_gb()}


def device_mem_gb():
    import jax
    st = jax.devices()[0].memory_stats() or {}
    peak = st.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def rollout_rows(mcfg, a) -> list[dict]:
    from maxpost.model import create_model, num_params
    from maxpost.sampling import generate
    mcfg = dataclasses.replace(mcfg, param_dtype="bfloat16")   # weights in bf16, as a serving engine keeps them
    model = create_model(mcfg, seed=0)
    weight_bytes = num_params(mcfg) * 2     # every bf16 weight, read once a decode step
    rows, seed = [], iter(range(10**6))
    for b in a.batches:
        prompts = common.prompt_ids(b, a.prompt, mcfg.vocab_size, seed=1)
        def one():
            r = generate(model, prompts, max_prompt_length=a.prompt, max_completion_length=a.new, temperature=1.0,
                         eos_ids=(), seed=next(seed))
            return int(r.completion_mask.sum())
        t = common.time_calls(one, warmup=0, reps=a.reps); s = t["median_s"]
        rows.append({"what": "maxpost generate", "batch": b, "call_s": s, "first_s": t["first_call_s"],
                     "tokens_per_s": t["tokens_per_s"], "ms_per_step": 1e3 * s / a.new,
                     "hbm_frac": weight_bytes * a.new / s / (a.hbm_tbs * 1e12)})
    return rows


def hf_rows(mcfg, a) -> list[dict]:
    "transformers' generate on the same chip, bf16, sdpa attention, random weights of the same shape."
    import torch, transformers
    from maxpost.checkpoint import model_config_to_hf_config
    d = model_config_to_hf_config(mcfg)
    d.pop("architectures"); mtype = d.pop("model_type"); d.pop("torch_dtype", None); d["dtype"] = "bfloat16"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu": torch.set_num_threads(common.THREADS)
    torch.manual_seed(0)
    hcfg = transformers.CONFIG_MAPPING[mtype](**d, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="sdpa",
                                                          dtype=torch.bfloat16).to(dev).eval()
    rows = []
    for b in a.batches:
        ids = torch.tensor(common.prompt_ids(b, a.prompt, mcfg.vocab_size, seed=1), device=dev)
        def one():
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=a.new, min_new_tokens=a.new,
                                     pad_token_id=0, eos_token_id=None)
            if dev == "cuda": torch.cuda.synchronize()
            return int(out.shape[0] * (out.shape[1] - ids.shape[1]))
        t = common.time_calls(one, warmup=0, reps=a.reps)
        rows.append({"what": "transformers generate", "batch": b, "call_s": t["median_s"], "first_s": t["first_call_s"],
                     "tokens_per_s": t["tokens_per_s"], "ms_per_step": 1e3 * t["median_s"] / a.new})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--param-dtype", default="float32", help="float32: mixed precision; bfloat16: all bf16")
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate (needs torch)")
    ap.add_argument("--skip-sft", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny preset, short shapes: a CPU smoke run")
    a = ap.parse_args()
    if a.quick:
        a.preset, a.seq, a.batch, a.batches, a.new, a.reps, a.matmul_n = "tiny", 128, 2, [1, 4], 16, 2, 512
    import jax
    from maxpost.model import get_model_config, num_params
    mcfg = get_model_config(a.preset, dtype="bfloat16", param_dtype=a.param_dtype)
    dev = jax.devices()[0]
    head = {"preset": a.preset, "params": num_params(mcfg), "device": f"{dev.platform} {dev.device_kind}",
            "devices": jax.device_count(), "jax": jax.__version__, "args": vars(a)}
    print(json.dumps(head), flush=True)
    peak = matmul_peak(a.matmul_n, reps=10 if not a.quick else 3)
    print(f"bf16 matmul {a.matmul_n}^3: {peak / 1e12:.1f} TFLOP/s", flush=True)
    out = {**head, "matmul_peak_tflops": peak / 1e12, "sft": None, "rollout": [], "hf": []}
    tables = []
    if not a.skip_sft:
        r = sft_row(mcfg, a); r["mfu_measured"] = r["model_tflops"] * 1e12 / peak; out["sft"] = r
        tables.append(common.print_table(
            f"SFT step, {a.preset} bf16 compute ({a.param_dtype} params), seq {a.seq} x batch {a.batch}", [r],
            [("step_s", "step s"), ("tokens_per_s", "tokens/s"), ("model_tflops", "model TFLOP/s"),
             ("mfu_spec", "MFU vs spec peak"), ("mfu_measured", "MFU vs measured matmul"), ("first_s", "first step s"),
             ("device_mem_gb", "peak device GiB")]))
    out["rollout"] = rollout_rows(mcfg, a)
    if a.hf:
        out["hf"] = hf_rows(mcfg, a)
        by_b = {r["batch"]: r for r in out["hf"]}
        for r in out["rollout"]: r["maxpost_over_hf"] = r["tokens_per_s"] / by_b[r["batch"]]["tokens_per_s"]
    tables.append(common.print_table(
        f"Rollout, {a.preset} bf16, prompt {a.prompt}, {a.new} new tokens", out["rollout"] + out["hf"],
        [("what", "engine"), ("batch", "batch"), ("tokens_per_s", "tokens/s"), ("ms_per_step", "ms / step"),
         ("hbm_frac", "weights' share of HBM bandwidth"), ("maxpost_over_hf", "maxpost / transformers"),
         ("first_s", "first call s")]))
    out["tables"] = "".join(tables)
    p = common.save_results(f"accelerator_{a.preset}", out)
    if os.environ.get("OUT"): shutil.copy(p, Path(os.environ["OUT"]) / p.name)
    print(f"wrote {p}")


if __name__ == "__main__":
    main()
