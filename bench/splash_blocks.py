"""The attention of one 1B layer alone on a TPU: Splash attention's block sizes, its fused backward, and maxpost's `attend`.

The 1B SFT step's profile on one v5e chip (bench/device/README.md) spent about 0.5 s of 1.38 s in Splash attention's
kernels, run at the JAX default block size of 128. This times the forward and backward of causal attention at the
1B preset's heads (32 query heads of 64, 8 kv heads) on [batch, seq] rows, one sequence a row, for each block size,
with and without the fused backward kernel, and `maxpost.attention.attend` as the model calls it (`auto`: the Splash
branch under a `lax.cond` with the blockwise fallback) and the blockwise kernel alone. Each line: the median of
`--reps` timed calls after a warm-up, and the model FLOPs' rate (causal: half of 4 b t^2 n h forward, 2.5x that for
forward and backward).

    python bench/splash_blocks.py                    # on a TPU (interpret mode elsewhere: use --quick)
    python bench/splash_blocks.py --quick            # tiny shapes, any backend, to rehearse
"""
from __future__ import annotations
import argparse, json, statistics, time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="*", default=[128, 256, 512, 1024])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    import jax, jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from maxpost.attention import Spans, attend
    b, t, n, k, h = (2, 256, 4, 2, 64) if a.quick else (a.batch, a.seq, 32, 8, 64)
    blocks = [128, 256] if a.quick else [x for x in a.blocks if x <= t]
    interpret = jax.default_backend() != "tpu"
    key = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(key[0], (b, n, t, h), jnp.bfloat16)
    kk, v = (jax.random.normal(x, (b, k, t, h), jnp.bfloat16) for x in key[1:])
    seg = jnp.ones((b, t), jnp.int32)
    flops = 2.5 * 4 * b * t * t * n * h / 2

    def timeit(name, f, *args):
        g = jax.jit(jax.grad(lambda *xs: f(*xs).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        t0 = time.perf_counter(); jax.block_until_ready(g(*args)); first = time.perf_counter() - t0
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter(); jax.block_until_ready(g(*args)); times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        print(json.dumps({"what": name, "b": b, "t": t, "ms": round(ms, 3), "first_s": round(first, 2),
                          "tflops": round(flops / ms / 1e9, 1)}), flush=True)

    for blk in blocks:
        for fused in (False, True):
            bs = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                               block_kv_dkv_compute=blk, block_q_dq=None if fused else blk,
                               block_kv_dq=None if fused else blk, use_fused_bwd_kernel=fused)
            kernel = sk.make_splash_mha(sm.MultiHeadMask([sm.CausalMask((t, t))] * n), block_sizes=bs, head_shards=1,
                                        q_seq_shards=1, interpret=interpret)
            f = lambda q, kk, v, kernel=kernel: jax.vmap(kernel)(q * 0.125, kk, v, segment_ids=sk.SegmentIds(seg, seg))
            timeit(f"splash block {blk}{' fused bwd' if fused else ''}", f, q, kk, v)
    spans = Spans(jnp.broadcast_to(jnp.arange(t), (b, t)), seg, jnp.broadcast_to(jnp.arange(t), (b, t)), seg)
    for impl in ("auto", "blockwise"):   # maxpost's layouts: q [B,T,N,H], k [B,K,H,S], v [B,K,S,H]
        f = lambda q, kk, v, impl=impl: attend(q.transpose(0, 2, 1, 3), kk.transpose(0, 1, 3, 2), v, spans, 0.125,
                                               causal=True, implementation=impl)
        timeit(f"maxpost attend {impl}", f, q, kk, v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
