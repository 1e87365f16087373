"""FLOPs the compiled SFT step does against the model's own FLOPs (6N plus attention), per remat policy, from shapes.

MFU counts the model's FLOPs (`maxpost.timing.flops_per_token`: 6N plus attention); the compiled step does more where
remat recomputes the forward. This script lowers and compiles the whole SFT step (loss, gradient, clipping, AdamW) of
a preset from `jax.ShapeDtypeStruct`s (nothing allocated, any preset on a CPU) and reads XLA's `cost_analysis()`:
its FLOPs and bytes accessed, for each remat policy. XLA counts a `while` loop's body once, so the layers are
unrolled here (`scan_layers=False`) and the output layer's loss is taken in one piece (`chunk_size=None`, not the
chunks of `logits_chunk_size`, another loop): the count is the whole step's, the arithmetic the real program does.
The ratio hlo/model is the ceiling remat puts on MFU: at ratio r, a step at the hardware's peak reaches MFU 1/r.

    python bench/step_flops.py                                  # llama3.2-1b, 8 x 1024, remat none minimal full
    python bench/step_flops.py --preset qwen3-0.6b --remat full
"""
from __future__ import annotations
import argparse, dataclasses, json, time


def measure(preset: str, batch: int, seq: int, remat: str) -> dict:
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from maxpost.model import Decoder, get_model_config
    from maxpost.sft import make_sft_step
    from maxpost.timing import flops_per_token
    cfg = get_model_config(preset, dtype="bfloat16", param_dtype="float32", remat=remat)
    cfg = dataclasses.replace(cfg, scan_layers=False)        # cost_analysis counts a scan's body once
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    args = (params, rest, jax.eval_shape(tx.init, params), dict(tokens=ids, positions=ids, segment_ids=ids, loss_mask=ids))
    t0 = time.perf_counter()
    compiled = make_sft_step(graphdef, tx, accum=1, chunk_size=None).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = sum(x.size for x in jax.tree.leaves(params))
    model = flops_per_token(cfg, seq) * batch * seq
    return dict(preset=preset, tokens=batch * seq, remat=remat, params=int(n), model_tflops=round(model / 1e12, 2),
                six_n_tflops=round(6 * n * batch * seq / 1e12, 2), hlo_tflops=round(cost["flops"] / 1e12, 2),
                hlo_over_model=round(cost["flops"] / model, 3), bytes_accessed_gb=round(cost["bytes accessed"] / 1e9, 1),
                compile_s=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--remat", nargs="+", default=["none", "minimal", "full"])
    a = p.parse_args()
    for r in a.remat: print(json.dumps(measure(a.preset, a.batch, a.seq, r)), flush=True)
