"""Where a decode step's KV-cache write goes on an accelerator: cache layouts side by side, without the weights.

    python bench/device/probe_cache_layout.py                 # Llama 3.2 1B's cache: 16 layers, 64 rows, 8 KV heads of 64
    python bench/device/probe_cache_layout.py --quick         # small shapes: a rehearsal on a CPU

The fifth device session (bench/device/README.md) found 3.4 ms of a 9.1 ms decode step at 1B in the scan's writes
into the stacked cache (keys `[L,B,K,H,S]`, values `[L,B,K,S,H]`: `S` among the two minor axes, which a TPU tiles).
Each variant runs `--steps` decode steps in one `fori_loop`, each step a `lax.scan` over the layers that computes the
layer's new key and value from the running activation, reads the layer's cache (one query per row over the slots
before the step's, as `attend_step` does) and writes the new key and value at the step's slot; no weights, so what is
timed is the cache's traffic and its structure. A variant is `<keys' axes>/<values' axes>[/<mode>]` over b (row),
k (KV head), h (head dim), s (slot), each cache stacked on a leading layer axis. Modes:

    inside   (default) the caches in the scan's carry; each layer reads its slice, then writes it (maxpost until the tail)
    after    the caches in the carry, read only; one write after the scan puts every layer's key and value in
    first    the caches in the carry; each layer writes first, then reads its slice (the new slot masked out)
    xs       the caches as the scan's `xs` (each layer's slice an input, never carried); one write after the scan
    ys       the caches as `xs`; each layer returns its written slice as `ys`, stacked into the new caches
    dma      as inside, each write one DMA from a Pallas kernel whose output aliases the cache (TPU only)
    dma_after  as after, the one write a DMA
    read_only  maxpost's cache with no writes: the floor
    tail<C>  (a whole variant) the main caches read only in loops of C steps, each step written into a tail of C
             slots (slot major), the tail put in after each loop; `tail<C>m`: the tail slot minor

    bkhs/bksh         maxpost's cache
    skbh/skbh         MaxText's `ar_cache_axis_order` 1,2,0,3 (slot major; rows and head dim minor)
    sbkh/sbkh         slot major, heads and head dim minor
    bksh/bksh         keys laid out as the values

The sixth session (2026-12-07) found every layout within 1 % of the others and every write mode above, the Pallas
DMA included, 3.6-3.9 ms a step over `read_only`: the one-slot write into a cache whose slot axis a TPU keeps in the
lanes. Only the tail avoids it (`tail32`: 1.85 ms a step against 4.80); maxpost's sampler
decodes that way since (`with_tail`, chapter 02_model), and since the eighth session writes the tail once after the
layers' scan instead of in it (the tail here is still written inside the scan).

Prints ms a step for each (best of `--repeats` calls after a first that compiles) and what reading the cache once
costs at the HBM bandwidth given.
"""
from __future__ import annotations
import argparse, os, re, time
import jax, jax.numpy as jnp

NEG = -1e30
VARIANTS = "bkhs/bksh,tail32,tail64,tail32m,tail128,read_only"


def shape_of(axes: str, dims: dict) -> tuple:
    return tuple(dims[a] for a in axes)


INTERPRET = False          # --quick: Pallas in interpret mode (a CPU)


def dma_write(cache, new, axes: str, layer, index):
    "`new` ([n, *axes] with s of 1) into `cache` at layer `layer` and slot `index` by one DMA from a Pallas TPU kernel whose output is the cache itself (`input_output_aliases`): in place by construction."
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    def kernel(pos_ref, new_ref, cache_in_ref, cache_out_ref, sem):
        where = (pl.ds(pos_ref[0], new_ref.shape[0]),) + tuple(pl.ds(pos_ref[1], 1) if a == "s" else slice(None) for a in axes)
        copy = pltpu.make_async_copy(new_ref, cache_out_ref.at[where], sem)
        copy.start(); copy.wait()
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.MemorySpace.SMEM), pl.BlockSpec(memory_space=pl.ANY),
                                    pl.BlockSpec(memory_space=pl.ANY)],
                          out_specs=pl.BlockSpec(memory_space=pl.ANY), scratch_shapes=[pltpu.SemaphoreType.DMA],
                          input_output_aliases={2: 0}, interpret=pltpu.InterpretParams() if INTERPRET else False)(
        jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(index, jnp.int32)]), new, cache)


def write_slot(cache, new_bkh, axes: str, layer, index, dma: bool = False):
    "`new_bkh` ([B,K,H], or [L,B,K,H] with `layer=None`: every layer) into `cache` ([L, *axes]) at slot `index`; `dma`: by `dma_write`."
    every = layer is None
    new = new_bkh[..., None]                                              # [(L,)B,K,H,1]: s last
    perm = [("bkhs".index(a) + every) for a in axes]
    new = jnp.transpose(new, ([0] if every else []) + perm)
    if not every: new = new[None]
    if dma: return dma_write(cache, new.astype(cache.dtype), axes, 0 if every else layer, index)
    start = [0 if every else layer] + [index if a == "s" else 0 for a in axes]
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def tail_loop(dims: dict, steps: int, start: int, chunk: int, minor: bool):
    "Mode `tail<C>`: the main caches (bkhs/bksh) read only inside a loop of C steps, each step's keys and values written into a tail of C slots ([C,L,B,K,H], slot major; `tail<C>m`: [L,B,K,H,C], slot minor), the tail put into the main caches after each loop (one write of C slots)."
    S, L = dims["s"], dims["l"]

    def chunk_body(c, carry):
        x_bkgh, kc, vc = carry
        base = start + c * chunk

        def step(j, inner):
            x_bkgh, kt, vt = inner
            index = base + j
            valid = (jnp.arange(S) < base)[None, None, None]          # the main caches' slots before this loop's
            valid_t = (jnp.arange(chunk) < j)[None, None, None]       # the tail's slots before this step's

            def layer(inner, i):
                x, kt, vt = inner
                nk, nv = x[:, :, 0] * 0.5, x[:, :, 0] * 0.25
                if minor:
                    kt = jax.lax.dynamic_update_slice(kt, nk[None, ..., None].astype(kt.dtype), (i, 0, 0, 0, j))
                    vt = jax.lax.dynamic_update_slice(vt, nv[None, ..., None].astype(vt.dtype), (i, 0, 0, 0, j))
                    kt_l = jax.lax.dynamic_index_in_dim(kt, i, 0, keepdims=False)           # [B,K,H,C]
                    vt_l = jax.lax.dynamic_index_in_dim(vt, i, 0, keepdims=False)
                    st = jnp.einsum("bkgh,bkhc->bkgc", x, kt_l, preferred_element_type=jnp.float32)
                else:
                    kt = jax.lax.dynamic_update_slice(kt, nk[None, None].astype(kt.dtype), (j, i, 0, 0, 0))
                    vt = jax.lax.dynamic_update_slice(vt, nv[None, None].astype(vt.dtype), (j, i, 0, 0, 0))
                    kt_l = jax.lax.dynamic_index_in_dim(kt, i, 1, keepdims=False)           # [C,B,K,H]
                    vt_l = jax.lax.dynamic_index_in_dim(vt, i, 1, keepdims=False)
                    st = jnp.einsum("bkgh,cbkh->bkgc", x, kt_l, preferred_element_type=jnp.float32)
                k_l = jax.lax.dynamic_index_in_dim(kc, i, 0, keepdims=False)
                v_l = jax.lax.dynamic_index_in_dim(vc, i, 0, keepdims=False)
                sm = jnp.einsum("bkgh,bkhs->bkgs", x, k_l, preferred_element_type=jnp.float32)
                sc = jnp.concatenate([jnp.where(valid, sm, NEG), jnp.where(valid_t, st, NEG)], -1)
                p = jax.nn.softmax(sc, axis=-1).astype(v_l.dtype)
                o = jnp.einsum("bkgs,bksh->bkgh", p[..., :S], v_l)
                o = o + (jnp.einsum("bkgc,bkhc->bkgh", p[..., S:], vt_l) if minor else
                         jnp.einsum("bkgc,cbkh->bkgh", p[..., S:], vt_l))
                return ((x + o * 0.01).astype(x.dtype), kt, vt), None

            (x_bkgh, kt, vt), _ = jax.lax.scan(layer, (x_bkgh, kt, vt), jnp.arange(L))
            return x_bkgh, kt, vt

        shape = (L, dims["b"], dims["k"], dims["h"], chunk) if minor else (chunk, L, dims["b"], dims["k"], dims["h"])
        kt = vt = jnp.zeros(shape, kc.dtype)
        x_bkgh, kt, vt = jax.lax.fori_loop(0, chunk, step, (x_bkgh, kt, vt))
        k_new = kt if minor else kt.transpose(1, 2, 3, 4, 0)                             # [L,B,K,H,C]
        v_new = (vt if minor else vt.transpose(1, 2, 3, 4, 0)).swapaxes(-1, -2)           # [L,B,K,C,H]
        return (x_bkgh, jax.lax.dynamic_update_slice(kc, k_new, (0, 0, 0, 0, base)),
                jax.lax.dynamic_update_slice(vc, v_new, (0, 0, 0, base, 0)))

    def run(x, kc, vc): return jax.lax.fori_loop(0, steps // chunk, chunk_body, (x, kc, vc))
    return jax.jit(run, donate_argnums=(1, 2)), "bkhs", "bksh"


def make_loop(variant: str, dims: dict, steps: int, start: int):
    tail = re.fullmatch(r"tail(\d+)(m?)", variant)
    if tail: return tail_loop(dims, steps, start, int(tail.group(1)), bool(tail.group(2)))
    kax, vax, *rest = (variant if variant != "read_only" else "bkhs/bksh/none").split("/")
    mode = rest[0] if rest else "inside"
    dma = mode.startswith("dma")
    mode = {"dma": "inside", "dma_after": "after"}.get(mode, mode)
    S = dims["s"]

    def step(t, carry):
        x_bkgh, kc, vc = carry
        index = start + t
        valid = (jnp.arange(S) < index)[None, None, None]        # the slots before this step's: the same in every mode

        def attend(x, k_l, v_l):
            sc = jnp.einsum(f"bkgh,{kax}->bkgs", x, k_l, preferred_element_type=jnp.float32)
            p = jax.nn.softmax(jnp.where(valid, sc, NEG), axis=-1).astype(v_l.dtype)
            o = jnp.einsum(f"bkgs,{vax}->bkgh", p, v_l)
            return (x + o * 0.01).astype(x.dtype)

        def new_kv(x): return x[:, :, 0] * 0.5, x[:, :, 0] * 0.25     # [B,K,H]: this layer's key and value

        def carried(c, i):                                       # modes inside, after, first, none
            x, kc, vc = c
            nk, nv = new_kv(x)
            if mode == "first": kc, vc = write_slot(kc, nk, kax, i, index), write_slot(vc, nv, vax, i, index)
            k_l = jax.lax.dynamic_index_in_dim(kc, i, 0, keepdims=False)
            v_l = jax.lax.dynamic_index_in_dim(vc, i, 0, keepdims=False)
            x = attend(x, k_l, v_l)
            if mode == "inside": kc, vc = write_slot(kc, nk, kax, i, index, dma), write_slot(vc, nv, vax, i, index, dma)
            return (x, kc, vc), (nk, nv)

        def sliced(x, layer):                                    # modes xs, ys: each layer's slice a scan input
            k_l, v_l = layer
            nk, nv = new_kv(x)
            if mode == "ys":
                k_l = write_slot(k_l[None], nk, kax, 0, index)[0]
                v_l = write_slot(v_l[None], nv, vax, 0, index)[0]
            x = attend(x, k_l, v_l)
            return x, (k_l, v_l) if mode == "ys" else (nk, nv)

        if mode in ("xs", "ys"):
            x_bkgh, (a, b) = jax.lax.scan(sliced, x_bkgh, (kc, vc))
            if mode == "ys": return x_bkgh, a, b
            return x_bkgh, write_slot(kc, a, kax, None, index), write_slot(vc, b, vax, None, index)
        (x_bkgh, kc, vc), (nk, nv) = jax.lax.scan(carried, (x_bkgh, kc, vc), jnp.arange(dims["l"]))
        if mode == "after": kc, vc = write_slot(kc, nk, kax, None, index, dma), write_slot(vc, nv, vax, None, index, dma)
        return x_bkgh, kc, vc

    def run(x, kc, vc): return jax.lax.fori_loop(0, steps, step, (x, kc, vc))
    return jax.jit(run, donate_argnums=(1, 2)), kax, vax


PASS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call", "constant"}


def big_ops(compiled, min_bytes: int = 1 << 20) -> str:
    "The compiled program's instructions whose result is at least `min_bytes` (one layer's cache or more), by opcode, and XLA's count of bytes accessed: a copy or a materialized slice of the cache shows here."
    sizes = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1}
    found = {}
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* ([\w-]+)\(", line)
        if m and m.group(1) in sizes and m.group(3) not in PASS:
            n = sizes[m.group(1)]
            for d in filter(None, m.group(2).split(",")): n *= int(d)
            if n >= min_bytes:
                kind = re.search(r"kind=(\w+)", line)
                key = f"{m.group(3)}{'/' + kind.group(1) if kind else ''} {m.group(1)}[{m.group(2)}]"
                found[key] = found.get(key, 0) + 1
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    moved = (cost or {}).get("bytes accessed", float("nan")) / 1e6
    return f"{moved:.0f} MB accessed; " + ("; ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "no big results")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (a CPU rehearsal)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hbm-gbps", type=float, default=819.0, help="the chip's HBM bandwidth (v5e: 819 GB/s)")
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--dump", default="", help="a folder: each variant's optimized HLO written there (<variant>.hlo.txt)")
    a = p.parse_args(argv)
    global INTERPRET
    INTERPRET = a.quick
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
        try:
            compiled = fn.lower(x, kc, vc).compile()
            copies = big_ops(compiled, 1 << (10 if a.quick else 20))
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                with open(os.path.join(a.dump, variant.replace("/", "_") + ".hlo.txt"), "w") as f: f.write(compiled.as_text())
        except Exception as e:                                  # a DMA at an offset the TPU's tiles do not allow
            print(f"{variant:18s} does not compile: {str(e).strip().splitlines()[0][:200]}", flush=True)
            continue
        t = time.perf_counter(); x, kc, vc = jax.block_until_ready(fn(x, kc, vc)); first = time.perf_counter() - t
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter(); x, kc, vc = jax.block_until_ready(fn(x, kc, vc)); best = min(best, time.perf_counter() - t)
        canon = [jnp.transpose(c, [0] + [1 + ax.index(a) for a in "bkhs"]) for c, ax in ((kc, kax), (vc, vax))]
        ref = canon if ref is None else ref                      # the first variant's caches, in one axis order
        same = variant == "read_only" or all(bool(jnp.array_equal(c, r)) for c, r in zip(canon, ref))
        print(f"{variant:18s} {1e3 * best / steps:8.3f} ms a step (first call {first:.1f} s); the caches "
              f"{'equal' if same else 'DIFFER from'} the first variant's; {copies}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
