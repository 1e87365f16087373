"""One process of a 2-process CPU run (tests/test_multihost.py): sharded forward + gradient of a small MLP.

Run as `python tests/multihost_worker.py OUT_DIR` with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set.
Importing this file only defines the model and the step (the test uses them for the single-process reference).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxpost.sharding import constrain, logical_init, param_shardings

B, T, D, F = 16, 4, 16, 32
MESHES = {"data2-fsdp2-tensor2": dict(data=2, fsdp=2, tensor=2), "fsdp8": dict(fsdp=8)}


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.3)
        self.w1 = nnx.Param(logical_init(init, ("embed", "mlp"))(rngs.params(), (D, F)))
        self.w2 = nnx.Param(logical_init(init, ("mlp", "embed"))(rngs.params(), (F, D)))
        self.wk = nnx.Param(logical_init(init, ("embed", "kv_heads", "head_dim"))(rngs.params(), (D, 2, 8)))
        self.scale = nnx.Param(jnp.ones((D,)))

    def __call__(self, x_btd):
        h = constrain(jax.nn.relu(jnp.einsum("btd,df->btf", x_btd, self.w1[...])), ("batch", "length", "mlp"))
        y = x_btd + constrain(jnp.einsum("btf,fd->btd", h, self.w2[...]), ("batch", "length", "embed"))
        k = jnp.tanh(jnp.einsum("btd,dkh->btkh", y, self.wk[...]))
        return y * self.scale[...] + jnp.sum(k, axis=(2, 3))[..., None]


def global_batch() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)


def step(model, x, mesh=None):
    """Forward output, loss and gradients; with a mesh, gradients come back in the parameters' layout."""
    gd, st = nnx.split(model)

    def loss(st, x):
        y = nnx.merge(gd, st)(x)
        return jnp.mean(jnp.square(y - 1.0)), y

    out = None if mesh is None else ((NamedSharding(mesh, P()), None), param_shardings(st, mesh))
    (l, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True), out_shardings=out)(st, x)
    return y, l, {k: v[...] for k, v in g.items()}


def main(out_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    from jax.experimental import multihost_utils
    from maxpost.sharding import init_distributed, make_mesh, process_batch_slice, shard_batch, shard_model

    assert init_distributed() is True  # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    pid = jax.process_index()
    info = dict(process_count=jax.process_count(), device_count=jax.device_count(),
                local_device_count=jax.local_device_count())
    x = global_batch()
    results = {}
    for name, kw in MESHES.items():
        mesh = make_mesh(**kw)
        rows = process_batch_slice(mesh, B)
        with jax.set_mesh(mesh):
            model = shard_model(MLP(rngs=nnx.Rngs(0)), mesh)         # every process holds the same init
            xs = shard_batch({"x": x[rows]}, mesh)["x"]                 # ...but only its own rows of the batch
            assert xs.shape == (B, T, D) and not xs.is_fully_addressable
            y, l, g = step(model, xs, mesh)
            assert not g["w1"].is_fully_addressable
            full = multihost_utils.process_allgather({"y": y, "loss": l, **g}, tiled=True)
        results.update({f"{name}/{k}": np.asarray(v) for k, v in full.items()})
        results[f"{name}/rows"] = np.array([rows.start, rows.stop])
    np.savez(f"{out_dir}/process{pid}.npz", **results, **{f"info/{k}": v for k, v in info.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
