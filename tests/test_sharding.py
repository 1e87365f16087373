"""maxpost.sharding on 8 virtual CPU devices: meshes, the rules table, fallbacks, and sharded == unsharded numerics."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxpost.sharding import (AXES, LOGICAL_RULES, batch_sharding, constrain, create_sharded, init_distributed,
                              logical_init, logical_spec, make_mesh, mesh_shape, param_shardings,
                              process_batch_slice, shard_batch, shard_model)

def same_layout(arr, mesh, spec):
    """Whether `arr` is laid out as `spec` on `mesh` (jax drops trailing Nones from specs it reports)."""
    return arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim)


MESHES = [dict(data=8, fsdp=1), dict(fsdp=8), dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=2, tensor=4)]


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("kw, want", [
    (dict(), (1, 8, 1)), (dict(data=-1, fsdp=1), (8, 1, 1)), (dict(fsdp=1, tensor=-1), (1, 1, 8)),
    (dict(data=2, tensor=2), (2, 2, 2)), (dict(data=-1, fsdp=2, tensor=2), (2, 2, 2)), (dict(data=4, tensor=2), (4, 1, 2))])
def test_mesh_shapes(kw, want):
    mesh = make_mesh(**kw)
    assert mesh.axis_names == AXES
    assert tuple(mesh.shape[a] for a in AXES) == want
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("kw", [dict(data=-1, fsdp=-1), dict(data=3), dict(data=2, fsdp=2, tensor=1), dict(data=0)])
def test_bad_mesh_shapes(kw):
    with pytest.raises(ValueError):
        make_mesh(**kw)


def test_mesh_on_subset_of_devices():
    assert mesh_shape(num_devices=1) == (1, 1, 1)
    mesh = make_mesh(data=-1, devices=jax.devices()[:2], fsdp=1)
    assert mesh.shape["data"] == 2 and mesh.devices.size == 2


def test_rules_table_is_the_contract():
    assert dict(LOGICAL_RULES) == {"batch": ("data", "fsdp"), "layers": None, "length": None, "embed": "fsdp", "mlp": "tensor",
                                   "heads": "tensor", "kv_heads": "tensor", "head_dim": None, "vocab": "tensor"}


@pytest.mark.parametrize("names, want", [
    (("embed", "mlp"), P("fsdp", "tensor")), (("mlp", "embed"), P("tensor", "fsdp")),
    (("vocab", "embed"), P("tensor", "fsdp")), (("embed", "heads", "head_dim"), P("fsdp", "tensor", None)),
    (("heads", "head_dim", "embed"), P("tensor", None, "fsdp")), (("batch", "length"), P(("data", "fsdp"), None)),
    (("batch", "length", "embed"), P(("data", "fsdp"), None, None)),        # fsdp only once per array
    (("batch", "length", "heads", "head_dim"), P(("data", "fsdp"), None, "tensor", None)),
    ((None, "embed"), P(None, "fsdp")), (("fsdp", "tensor"), P("fsdp", "tensor"))])  # raw mesh axes pass through
def test_logical_spec(names, want):
    assert logical_spec(names) == want


def test_unknown_logical_name_fails():
    with pytest.raises(KeyError):
        logical_spec(("embd", "mlp"))


def test_custom_rules():
    assert logical_spec(("embed", "mlp"), rules=(("embed", None), ("mlp", ("fsdp", "tensor")))) == P(None, ("fsdp", "tensor"))


@pytest.mark.parametrize("shape, kw, want", [
    ((256, 2, 64), dict(fsdp=2, tensor=4), P("fsdp", None, None)),          # 2 kv heads on tensor=4: replicated
    ((256, 4, 64), dict(fsdp=2, tensor=4), P("fsdp", "tensor", None)),
    ((6, 8), dict(fsdp=8), P(None, "tensor")),                             # embed 6 on fsdp=8 (tensor=1)
    ((2, 16), dict(data=2, fsdp=4), P("data", None)),                       # batch 2 keeps the axes that divide
    ((3, 16), dict(data=2, fsdp=4), P(None, None))])
def test_non_divisible_fallback(shape, kw, want):
    names = {3: ("embed", "kv_heads", "head_dim"), 2: ("embed", "mlp")}[len(shape)]
    if kw.get("data") == 2: names = ("batch", "length")
    mesh = make_mesh(**kw)
    spec = logical_spec(names, shape, mesh)
    assert spec == want
    x = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))  # jax accepts the fallback spec
    assert x.shape == shape


def test_constrain_identity_without_mesh():
    x = jnp.ones((4, 8))
    assert constrain(x, ("batch", "embed")) is x
    assert jax.jit(lambda x: constrain(x, ("batch", "embed")))(x).sharding.is_fully_replicated


def test_constrain_inside_jit():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    x = np.arange(8 * 6 * 4, dtype=np.float32).reshape(8, 6, 4)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: constrain(x + 1, ("batch", "length", "heads")))(x)
        z = jax.jit(lambda x: constrain(x, ("batch", "length", "kv_heads")))(x[:, :, :1])  # 1 head: replicated
    assert same_layout(y, mesh, P(("data", "fsdp"), None, "tensor"))
    assert same_layout(z, mesh, P(("data", "fsdp"), None, None))
    assert not same_layout(z, mesh, P(("data", "fsdp"), None, "tensor"))
    np.testing.assert_array_equal(np.asarray(y), x + 1)


def test_shard_batch_rows_over_data_fsdp():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    batch = {"tokens": np.arange(8 * 5, dtype=np.int32).reshape(8, 5), "loss_mask": np.ones((8, 5), np.int32)}
    out = shard_batch(batch, mesh)
    for k, v in out.items():
        assert v.sharding.spec == P(("data", "fsdp"), None)
        np.testing.assert_array_equal(np.asarray(v), batch[k])
    pos = {name: i for i, name in enumerate(mesh.axis_names)}
    for shard in out["tokens"].addressable_shards:
        coords = {a: int(c) for a, c in zip(mesh.axis_names, np.argwhere(mesh.devices == shard.device)[0])}
        block = coords["data"] * 2 + coords["fsdp"]                  # rows depend on (data, fsdp), not on tensor
        np.testing.assert_array_equal(np.asarray(shard.data), batch["tokens"][2 * block:2 * block + 2])
    assert pos["tensor"] == 2
    assert process_batch_slice(mesh, 8) == slice(0, 8)
    assert batch_sharding(mesh, (8, 5)).spec == P(("data", "fsdp"), None)
    assert shard_batch({"x": np.zeros((3, 2))}, mesh)["x"].sharding.spec == P(None, None)


def test_init_distributed_single_process(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert init_distributed() is False
    assert init_distributed(num_processes=1) is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert init_distributed() is False
    assert jax.process_count() == 1


# ---- sharded forward + gradient == one device ------------------------------------------------------------------

class MLP(nnx.Module):
    """x -> relu(x W1) W2 + attention-like projection onto 2 kv heads (exercises the fallback on tensor=4)."""
    def __init__(self, d=16, f=32, kv=2, hd=8, *, rngs):
        init = nnx.initializers.normal(0.3)
        self.w1 = nnx.Param(logical_init(init, ("embed", "mlp"))(rngs.params(), (d, f)))
        self.w2 = nnx.Param(logical_init(init, ("mlp", "embed"))(rngs.params(), (f, d)))
        self.wk = nnx.Param(logical_init(init, ("embed", "kv_heads", "head_dim"))(rngs.params(), (d, kv, hd)))
        self.wo = nnx.Param(logical_init(init, ("kv_heads", "head_dim", "embed"))(rngs.params(), (kv, hd, d)))
        self.scale = nnx.Param(jnp.ones((d,)))

    def __call__(self, x_btd):
        h = constrain(jax.nn.relu(jnp.einsum("btd,df->btf", x_btd, self.w1[...])), ("batch", "length", "mlp"))
        y = x_btd + constrain(jnp.einsum("btf,fd->btd", h, self.w2[...]), ("batch", "length", "embed"))
        k = constrain(jnp.einsum("btd,dkh->btkh", y, self.wk[...]), ("batch", "length", "kv_heads", "head_dim"))
        return (y + jnp.einsum("btkh,khd->btd", jnp.tanh(k), self.wo[...])) * self.scale[...]


def numpy_mlp(p, x):
    h = np.maximum(x @ p["w1"], 0)
    y = x + h @ p["w2"]
    k = np.tanh(np.einsum("btd,dkh->btkh", y, p["wk"]))
    return (y + np.einsum("btkh,khd->btd", k, p["wo"])) * p["scale"]


def _loss(model, x):
    return jnp.mean(jnp.square(model(x) - 1.0))


def loss_grads(model, x, mesh=None):
    gd, st = nnx.split(model)
    out = None if mesh is None else (NamedSharding(mesh, P()), param_shardings(st, mesh))
    f = jax.jit(jax.value_and_grad(lambda st, x: _loss(nnx.merge(gd, st), x)), out_shardings=out)
    return f(st, x)


def _x(b=16, t=4, d=16):
    return np.random.default_rng(0).normal(size=(b, t, d)).astype(np.float32)


def test_mlp_reference_matches_numpy():
    model, x = MLP(rngs=nnx.Rngs(0)), _x()
    p = {k: np.asarray(v[...]) for k, v in nnx.state(model).items()}
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), numpy_mlp(p, x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mlp_reference():
    cpu0 = jax.devices()[0]
    with jax.default_device(cpu0):
        loss, grads = loss_grads(MLP(rngs=nnx.Rngs(0)), jnp.asarray(_x()))
    return float(loss), {k: np.asarray(v[...]) for k, v in grads.items()}


@pytest.mark.parametrize("kw", MESHES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
@pytest.mark.parametrize("build", ["shard_model", "create_sharded"])
def test_mlp_sharded_equals_single_device(kw, build, mlp_reference):
    mesh = make_mesh(**kw)
    with jax.set_mesh(mesh):
        if build == "shard_model":
            model = shard_model(MLP(rngs=nnx.Rngs(0)), mesh)
        else:
            model = create_sharded(lambda: MLP(rngs=nnx.Rngs(0)), mesh)
        params = {k: v[...] for k, v in nnx.state(model).items()}
        x = shard_batch({"x": _x()}, mesh)["x"]
        out = jax.jit(lambda m, x: m(x))(model, x)
        loss, grads = loss_grads(model, x, mesh)
    want_specs = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed"), "wk": ("embed", "kv_heads", "head_dim"),
                  "wo": ("kv_heads", "head_dim", "embed")}
    for k, names in want_specs.items():
        spec = logical_spec(names, params[k].shape, mesh)
        assert same_layout(params[k], mesh, spec) and same_layout(grads[k][...], mesh, spec)
    if kw.get("tensor") == 4:
        assert same_layout(params["wk"], mesh, P("fsdp", None, None))  # 2 kv heads on tensor=4: replicated
    assert same_layout(params["w1"], mesh, logical_spec(("embed", "mlp")))  # 16 x 32 divides every mesh here
    assert same_layout(out, mesh, logical_spec(("batch", "length", "embed"), out.shape, mesh))
    ref_loss, ref_grads = mlp_reference
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for k, g in ref_grads.items():
        np.testing.assert_allclose(np.asarray(grads[k][...]), g, rtol=1e-4, atol=1e-6)


# ---- the real decoder ------------------------------------------------------------------------------------------


def _decoder_loss(model, tokens):
    logits = model(tokens)
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1))


def _decoder_step(model, tokens, mesh=None):
    gd, st, rest = nnx.split(model, nnx.Param, ...)
    out = None if mesh is None else (NamedSharding(mesh, P()), param_shardings(st, mesh))
    f = jax.jit(jax.value_and_grad(lambda st, t: _decoder_loss(nnx.merge(gd, st, rest), t)), out_shardings=out)
    return f(st, tokens)


@pytest.fixture(scope="module")
def decoder_reference():
    from maxpost.model import create_model, get_model_config
    cfg = get_model_config("tiny", num_layers=2, d_model=256, num_heads=4, num_kv_heads=2)
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, size=(8, 8)).astype(np.int32)
    with jax.default_device(jax.devices()[0]):
        loss, grads = _decoder_step(create_model(cfg, seed=0), jnp.asarray(tokens))
    return cfg, tokens, float(loss), {p: np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)}


@pytest.mark.parametrize("kw", [dict(data=8, fsdp=1), dict(fsdp=8), dict(data=2, fsdp=2, tensor=2),
                                dict(data=1, fsdp=2, tensor=4)], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_decoder_sharded_equals_single_device(kw, decoder_reference):
    """The `tiny` decoder (2 layers; 4 heads, 2 kv heads: kv replicated on tensor=4) sharded == one device."""
    from maxpost.model import create_model
    cfg, tokens, ref_loss, ref_grads = decoder_reference
    mesh = make_mesh(**kw)
    model = create_model(cfg, seed=0, mesh=mesh)  # (flax's nnx.eval_shape must run outside jax.set_mesh)
    params = nnx.state(model, nnx.Param)
    for v, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings(params, mesh))):
        assert v.sharding.is_equivalent_to(s, v.ndim)  # create_model places weights as our rules table says
    with jax.set_mesh(mesh):
        loss, grads = _decoder_step(model, shard_batch({"tokens": tokens}, mesh)["tokens"], mesh)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5)
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    assert flat.keys() == ref_grads.keys()
    split = 0
    for path, g in ref_grads.items():
        np.testing.assert_allclose(np.asarray(flat[path]), g, rtol=2e-4, atol=2e-6, err_msg=str(path))
        split += not flat[path].sharding.is_fully_replicated
    assert (split > 0) == (mesh.shape["fsdp"] * mesh.shape["tensor"] > 1)  # weights really split unless pure DP


@pytest.mark.parametrize("preset", ["llama3.2-1b", "qwen3-0.6b", "gemma3-1b"])
def test_init_as_one_program_per_array_is_bit_identical(preset, monkeypatch):
    """issue 47: on an accelerator `create_sharded` compiles the init as one program per array, side by side (a TPU
    compiles the whole init as one long job), and on a TPU runs them on the host's CPU (its compiler takes seconds for one
    array's draws); the arrays and their shardings are those of the one program."""
    from maxpost.model import Decoder, get_model_config
    from maxpost.sharding import make_mesh
    mesh = make_mesh(fsdp=4, tensor=2)
    cfg = get_model_config(preset, num_layers=3, vocab_size=512, dtype="float32", param_dtype="bfloat16")
    make = lambda **kw: jax.tree.leaves(nnx.state(create_sharded(lambda: Decoder(cfg, rngs=nnx.Rngs(3)), mesh, **kw)))
    a = make(split=False, host=False)
    import maxpost.sharding as ms
    drawn, place = [], ms._place
    monkeypatch.setattr(ms, "_place", lambda x, s: (drawn.append(x.sharding), place(x, s))[1])
    for b in (make(split=True, host=False), make(host=True)):    # per array on the devices; drawn on the host, then placed
        assert len(a) == len(b) > 10
        for x, y in zip(a, b):
            assert x.sharding == y.sharding and x.dtype == y.dtype
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert set(drawn) == {jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])} and len(drawn) == len(a)   # on the host
