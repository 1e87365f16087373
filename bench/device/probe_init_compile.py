"""Why a random init compiles for seconds on a TPU (bench/device/README.md, eighth session):

    python bench/device/probe_init_compile.py [--quick]

Compiles, one after another, each of Llama 3.2 1B's init programs (`_init_leaves`' split: one array's draws each),
then single draws of the largest MLP array's shape `[16, 2048, 8192]` (bf16): `jnp.ones` (a program's fixed cost),
`jax.random.normal` and `jax.random.truncated_normal` with the default threefry key, the same with
`jax_threefry_partitionable` off, and with an `rbg` key; each line: lower and compile seconds, and the compiled
program's size (HLO lines). `--quick`: the `tiny` model and a small shape (a CPU rehearsal)."""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax, jax.numpy as jnp
from flax import nnx
from maxpost.model import get_model_config, Decoder
from maxpost.sharding import _init_fn
P = lambda *a: print(*a, flush=True)
quick = "--quick" in sys.argv


def timed(name, f, *args):
    t = time.time(); low = jax.jit(f).lower(*args); tl = time.time() - t
    t = time.time(); c = low.compile(); tc = time.time() - t
    P(f"{name}: lower {tl:.2f} s, compile {tc:.2f} s, {c.as_text().count(chr(10))} HLO lines")
    return c


def main():
    t = time.time(); P(f"devices {jax.devices()} in {time.time() - t:.1f} s")
    cfg = get_model_config("tiny" if quick else "llama3.2-1b", dtype="bfloat16", param_dtype="bfloat16")
    box, init = _init_fn(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    closed, shapes = jax.make_jaxpr(init, return_shape=True)()
    leaves = jax.tree.leaves(shapes)
    run = jax.extend.core.jaxpr_as_fun(closed)
    order = sorted(range(len(leaves)), key=lambda i: leaves[i].size)          # the small ones (ones, norms) first
    for i in order: timed(f"init leaf {i} {leaves[i].shape}", lambda i=i: run()[i])
    shape = (2, 64, 256) if quick else (16, 2048, 8192)
    timed(f"ones {shape}", lambda: jnp.ones(shape, jnp.bfloat16))
    k = jax.random.key(0)
    timed("normal threefry", lambda k: jax.random.normal(k, shape, jnp.bfloat16), k)
    timed("truncated_normal threefry", lambda k: jax.random.truncated_normal(k, -2, 2, shape, jnp.bfloat16), k)
    timed("bits threefry", lambda k: jax.random.bits(k, shape, jnp.uint16), k)
    with jax.threefry_partitionable(False):
        timed("normal threefry, partitionable off", lambda k: jax.random.normal(k, shape, jnp.bfloat16), k)
    r = jax.random.key(0, impl="rbg")
    timed("normal rbg", lambda k: jax.random.normal(k, shape, jnp.bfloat16), r)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        c = timed("normal threefry on the host's CPU", lambda k: jax.random.normal(k, shape, jnp.bfloat16), jax.device_put(k, cpu))
        t = time.time(); x = jax.block_until_ready(c(jax.device_put(k, cpu))); tr = time.time() - t
    t = time.time(); y = jax.block_until_ready(jax.device_put(x, jax.devices()[0])); P(f"  its run {tr:.2f} s, to the device {time.time() - t:.2f} s")


if __name__ == "__main__":
    main()
