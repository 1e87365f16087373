"""Two probes on an accelerator (bench/device/README.md, fifth session), one per process:

    python bench/device/probe_init_decode.py init                  # the 1B init: one program against one per array
    python bench/device/probe_init_decode.py decode base|step|unroll_step

`init`: Llama 3.2 1B's random init (bf16) compiled as one program (what `create_sharded` did before) and as one
program per array compiled on threads (`_init_leaves`' split), run once each; prints both compile times and whether
the arrays are bit-equal. `decode`: `generate` at 1B, 64 rows of 64 prompt + 256 new tokens, greedy, on constant
weights (no init to compile; the speed does not depend on the values), first call (compile) then the best of two;
`step` sends every decode step through `attend_step` (what `Attention` does since this session; before it, only
with one KV head), `unroll_step` also unrolls the layers instead of scanning them. Then the same call with one new
token (the prefill and one step) and, from the two, the decode loop's own time a step.
"""
import concurrent.futures as cf, inspect, sys, textwrap, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
import maxpost.model as M
from maxpost.model import get_model_config, Decoder
from maxpost.sharding import _init_fn
from maxpost.sampling import generate
P = lambda *a: print(*a, flush=True)


def init_probe():
    cfg = get_model_config("llama3.2-1b", dtype="bfloat16", param_dtype="bfloat16")
    box, init = _init_fn(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(jax.eval_shape(init))
    pick = lambda i: (lambda: jax.tree.leaves(init())[i])
    t = time.time()
    with cf.ThreadPoolExecutor(len(leaves)) as ex:
        parts = list(ex.map(lambda i: jax.jit(pick(i)).lower().compile(), range(len(leaves))))
    P(f"per-leaf: {len(leaves)} programs compiled on threads in {time.time() - t:.1f} s")
    t = time.time(); whole = jax.jit(init).lower().compile(); P(f"whole init compile {time.time() - t:.1f} s")
    t = time.time(); w = jax.block_until_ready(jax.tree.leaves(whole())); P(f"whole run {time.time() - t:.2f} s")
    t = time.time(); p = jax.block_until_ready([c() for c in parts]); P(f"per-leaf run {time.time() - t:.2f} s")
    P("bit-equal:", all(bool(jnp.array_equal(a, b)) for a, b in zip(w, p)))
    t = time.time(); jax.jit(pick(0)).lower().compile(); P(f"one leaf alone (embed) {time.time() - t:.1f} s")


def decode_probe(variant: str):
    if "step" in variant:   # every decode step through `attend_step` (already so in a checkout after this session)
        src = textwrap.dedent(inspect.getsource(M.Attention.__call__)).replace(" and c.num_kv_heads == 1", "")
        exec(src, M.__dict__)
    cfg = get_model_config("llama3.2-1b", dtype="bfloat16", param_dtype="bfloat16", scan_layers="unroll" not in variant)
    gd, st = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    st = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype) * (1 + jnp.arange(x.shape[-1], dtype=x.dtype) % 7), st)
    model = nnx.merge(gd, st)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, cfg.vocab_size, 64)) for _ in range(64)]
    run = lambda: generate(model, prompts, max_prompt_length=64, max_completion_length=256, temperature=0.0, eos_ids=())
    t = time.time(); r = run(); P(f"{variant}: first call (compile) {time.time() - t:.1f} s")
    ts = []
    for _ in range(2):
        t = time.time(); r = run(); ts.append(time.time() - t)
    P(f"{variant}: call {min(ts):.3f} s, {1e3 * min(ts) / 256:.2f} ms a step; tokens[0,:8] "
      f"{r.completion_ids[0, :8].tolist()} sum {int(r.completion_ids.sum())}")
    one = lambda: generate(model, prompts, max_prompt_length=64, max_completion_length=1, temperature=0.0, eos_ids=())
    one(); t1 = []                                   # the prefill and one step: what the loop's other 255 steps add to
    for _ in range(2):
        t = time.time(); one(); t1.append(time.time() - t)
    P(f"{variant}: prefill and one step {min(t1):.3f} s; the other 255 steps {1e3 * (min(ts) - min(t1)) / 255:.2f} ms a step")


if __name__ == "__main__":
    P(jax.devices())
    init_probe() if sys.argv[1] == "init" else decode_probe(sys.argv[2])
