"""Cost of drawing one token per row at one decode step, filters off (the RL default: temperature 1, top_k=0, top_p=1).

Three versions of the same step, each jitted: what maxpost's decode step ran before (top-k / top-p filter that
always sorts the vocabulary, then `jax.random.categorical`, i.e. Gumbel-max with one uniform per vocabulary entry),
the filter with its `lax.cond` skip but still Gumbel-max, and maxpost's `sample_token` now (the `lax.cond` filter
and `draw_categorical`, a two-level inverse CDF with one uniform per row). All three draw from the same distribution.

    .venv/bin/python bench/sample_token.py            # prints a table: ms per call and the ratios to maxpost
"""
import argparse, os, statistics, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp
from maxpost.sampling import filter_logits, sample_token


def filter_always_sort(logits_bv, temperature, top_k, top_p):
    "The filter with no branch: sort, mask by rank and nucleus, keep what is at or above the smallest survivor."
    x = logits_bv.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    rank = jnp.arange(x.shape[-1])
    srt = -jnp.sort(-x, axis=-1)
    in_k = (top_k <= 0) | (rank < top_k)
    ps = jax.nn.softmax(jnp.where(in_k, srt, -jnp.inf), axis=-1)
    ahead = jnp.cumsum(ps, axis=-1) - ps
    keep = in_k & ((top_p >= 1.0) | (ahead < top_p) | (rank == 0))
    smallest = jnp.take_along_axis(srt, keep.sum(-1, keepdims=True) - 1, axis=-1)
    return jnp.where(x >= smallest, x, -jnp.inf)


def gumbel(filt):
    "The step with `filt` and `jax.random.categorical` (Gumbel-max)."
    return jax.jit(lambda key, z, t, k, p: jax.random.categorical(key, filt(z, t, k, p), axis=-1))


def ms_per_call(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))                     # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); jax.block_until_ready(fn(*args)); times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 8192, 151_936])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    versions = {"maxpost": jax.jit(sample_token), "cond filter + Gumbel": gumbel(filter_logits),
                "sort + Gumbel (before)": gumbel(filter_always_sort)}
    key = jax.random.key(0)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; top_k=0, top_p=1, temperature=1")
    print("| vocab | batch | " + " | ".join(f"{n} ms" for n in versions) + " | cond filter + Gumbel / maxpost | "
          "sort + Gumbel / maxpost |")
    print("|---|---|---|---|---|---|---|")
    for v in a.vocab:
        for b in a.batch:
            z = jax.random.normal(jax.random.key(v + b), (b, v), jnp.float32)
            args = (key, z, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
            ms = [ms_per_call(f, *args, reps=a.reps) for f in versions.values()]
            print(f"| {v} | {b} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {ms[1] / ms[0]:.1f}x | {ms[2] / ms[0]:.1f}x |",
                  flush=True)

if __name__ == "__main__":
    main()
