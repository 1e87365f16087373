"""Where a decode step's KV-cache write goes on an accelerator: cache layouts side by side, without the weights.

    python bench/device/probe_cache_layout.py                 # Llama 3.2 1B's cache: 16 layers, 64 rows, 8 KV heads of 64
    python bench/device/probe_cache_layout.py --quick         # small shapes: a rehearsal on a CPU

The fifth device session (bench/device/README.md) found 3.4 ms of a 9.1 ms decode step at 1B in the scan's writes
into the stacked cache (keys `[L,B,K,H,S]`, values `[L,B,K,S,H]`: `S` among the two minor axes, which a TPU tiles).
Each variant runs `--steps` decode steps in one `fori_loop`, each step a `lax.scan` over the layers that reads the
layer's cache (one query per row over every slot, as `attend_step` does) and writes the step's key and value at the
step's slot; no weights, so what is timed is the cache's traffic and its layout. A variant is
`<keys' axes>/<values' axes>[/after]` over b (row), k (KV head), h (head dim), s (slot), each cache stacked on a
leading layer axis; `after`: the scan returns the new keys and values and one write after it puts every layer's in
(else each layer writes inside the scan, as maxpost does). `read_only`: maxpost's layout with no writes, the floor.

    bkhs/bksh         maxpost today
    bkhs/bksh/after   the same, written after the scan
    skbh/skbh         MaxText's `ar_cache_axis_order` 1,2,0,3 (slot major; rows and head dim minor)
    sbkh/sbkh         slot major, heads and head dim minor
    bksh/bksh         keys laid out as the values

Prints ms a step for each (best of `--repeats` calls after a first that compiles) and what reading the cache once
costs at the HBM bandwidth given.
"""
from __future__ import annotations
import argparse, time
import jax, jax.numpy as jnp

NEG = -1e30
VARIANTS = "bkhs/bksh,bkhs/bksh/after,skbh/skbh,skbh/skbh/after,sbkh/sbkh,bksh/bksh,read_only"


def shape_of(axes: str, dims: dict) -> tuple:
    return tuple(dims[a] for a in axes)


def write_slot(cache, new_bkh, axes: str, layer, index):
    "`new_bkh` ([B,K,H], or [L,B,K,H] with `layer=None`: every layer) into `cache` ([L, *axes]) at slot `index`."
    every = layer is None
    new = new_bkh[..., None]                                              # [(L,)B,K,H,1]: s last
    perm = [("bkhs".index(a) + every) for a in axes]
    new = jnp.transpose(new, ([0] if every else []) + perm)
    if not every: new = new[None]
    start = [0 if every else layer] + [index if a == "s" else 0 for a in axes]
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def make_loop(variant: str, dims: dict, steps: int, start: int):
    kax, vax, *rest = (variant if variant != "read_only" else "bkhs/bksh/none").split("/")
    mode = rest[0] if rest else "inside"
    S = dims["s"]

    def step(t, carry):
        x_bkgh, kc, vc = carry
        index = start + t
        valid = (jnp.arange(S) < index)[None, None, None]

        def layer(c, i):
            x, kc, vc = c
            k_l = jax.lax.dynamic_index_in_dim(kc, i, 0, keepdims=False)
            v_l = jax.lax.dynamic_index_in_dim(vc, i, 0, keepdims=False)
            sc = jnp.einsum(f"bkgh,{kax}->bkgs", x, k_l, preferred_element_type=jnp.float32)
            p = jax.nn.softmax(jnp.where(valid, sc, NEG), axis=-1).astype(v_l.dtype)
            o = jnp.einsum(f"bkgs,{vax}->bkgh", p, v_l)
            new_k, new_v = o[:, :, 0] * 0.5, o[:, :, 0] * 0.25          # [B,K,H]: this layer's key and value
            x = (x + o * 0.01).astype(x.dtype)
            if mode == "inside": kc, vc = write_slot(kc, new_k, kax, i, index), write_slot(vc, new_v, vax, i, index)
            return (x, kc, vc), (new_k, new_v)

        (x_bkgh, kc, vc), (nk, nv) = jax.lax.scan(layer, (x_bkgh, kc, vc), jnp.arange(dims["l"]))
        if mode == "after": kc, vc = write_slot(kc, nk, kax, None, index), write_slot(vc, nv, vax, None, index)
        return x_bkgh, kc, vc

    def run(x, kc, vc): return jax.lax.fori_loop(0, steps, step, (x, kc, vc))
    return jax.jit(run, donate_argnums=(1, 2)), kax, vax


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU rehearsal)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hbm-gbps", type=float, default=819.0, help="the chip's HBM bandwidth (v5e: 819 GB/s)")
    p.add_argument("--variants", default=VARIANTS)
    a = p.parse_args(argv)
    dims = dict(zip("lbkghs", (2, 4, 2, 2, 16, 96) if a.quick else (16, 64, 8, 4, 64, 320)))
    steps = min(a.steps, dims["s"] - 64)
    dt = jnp.bfloat16
    cache_bytes = 2 * dims["l"] * dims["b"] * dims["k"] * dims["h"] * dims["s"] * 2
    print(f"{jax.devices()[0].device_kind}: {dims}, {steps} steps from slot 64; the cache {cache_bytes / 1e6:.0f} MB "
          f"(keys and values, bf16), read once a step: {1e3 * cache_bytes / (a.hbm_gbps * 1e9):.2f} ms at "
          f"{a.hbm_gbps:g} GB/s", flush=True)
    ref = None
    for variant in a.variants.split(","):
        fn, kax, vax = make_loop(variant, dims, steps, 64)
        x = jnp.full((dims["b"], dims["k"], dims["g"], dims["h"]), 0.1, dt)
        kc = jnp.full((dims["l"],) + shape_of(kax, dims), 0.01, dt)
        vc = jnp.full((dims["l"],) + shape_of(vax, dims), 0.02, dt)
        t = time.perf_counter(); x, kc, vc = jax.block_until_ready(fn(x, kc, vc)); first = time.perf_counter() - t
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter(); x, kc, vc = jax.block_until_ready(fn(x, kc, vc)); best = min(best, time.perf_counter() - t)
        canon = [jnp.transpose(c, [0] + [1 + ax.index(a) for a in "bkhs"]) for c, ax in ((kc, kax), (vc, vax))]
        ref = canon if ref is None else ref                      # the first variant's caches, in one axis order
        same = variant == "read_only" or all(bool(jnp.array_equal(c, r)) for c, r in zip(canon, ref))
        print(f"{variant:18s} {1e3 * best / steps:8.3f} ms a step (first call {first:.1f} s); the caches "
              f"{'equal' if same else 'DIFFER from'} the first variant's", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
