"""Scanned layers: one `lax.scan` over the stacked weights gives the logits and gradients of the unrolled loop over
the same weights (float32, CPU) for each preset family and remat policy; prefill + decode through the stacked cache
equals the full forward; the decode step writes the stacked cache in place; compile size does not grow with depth."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from maxpost.model import ModelConfig, Decoder, init_cache, grow_cache, get_model_config, mixed_windows

SMALL = dict(vocab_size=101, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)
FAMILIES = {   # tiny configs of each preset family; Gemma 3: 5 layers, a global one every 3 (5 is no multiple of 3)
    "llama": dataclasses.replace(get_model_config("llama3.2-1b"), num_layers=3, **SMALL, tie_embeddings=False,
                                 rope_original_max_len=16),
    "qwen3": dataclasses.replace(get_model_config("qwen3-0.6b"), num_layers=3, **SMALL),
    "gemma3": dataclasses.replace(get_model_config("gemma3-1b"), num_layers=5, **{**SMALL, "num_kv_heads": 1}, sliding_window=3,
                                  global_every=3, query_pre_attn_scalar=24.0),
}


def _tokens(seed, shape): return jax.random.randint(jax.random.key(seed), shape, 0, 101)


def _loss_and_grad(cfg, state, tokens, seg):
    graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(cfg)))[0]
    def loss(st):
        logits = nnx.merge(graphdef, st)(tokens, None, seg)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)


@pytest.mark.parametrize("remat", ["none", "minimal", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_equals_unrolled(family, remat):
    """Logits and every weight's gradient of the scanned decoder = the unrolled loop's, to 1e-5 (float32)."""
    cfg = dataclasses.replace(FAMILIES[family], remat=remat)
    assert mixed_windows(cfg) == (family == "gemma3")
    state = nnx.state(Decoder(cfg, rngs=nnx.Rngs(1)))
    tokens = _tokens(2, (2, 24))
    seg = jnp.ones((2, 24), jnp.int32).at[1, :5].set(0)
    (l_s, logits_s), g_s = _loss_and_grad(cfg, state, tokens, seg)
    (l_u, logits_u), g_u = _loss_and_grad(dataclasses.replace(cfg, scan_layers=False), state, tokens, seg)
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_u), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(l_s), float(l_u), atol=1e-6)
    flat_s, flat_u = dict(nnx.to_flat_state(g_s)), dict(nnx.to_flat_state(g_u))
    assert flat_s.keys() == flat_u.keys()
    for k in flat_s:
        a, b = np.asarray(flat_s[k].get_value()), np.asarray(flat_u[k].get_value())
        assert np.abs(a).max() > 0, k
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=str(k))


def test_gemma3_layer_kinds_follow_the_pattern():
    """Gemma 3's scanned layers attend locally or globally by their index: layer 2 (global) of 3 sees a token 8 back,
    and a model whose last layer is local cannot."""
    cfg = dataclasses.replace(FAMILIES["gemma3"], num_layers=3)       # local, local, global
    m = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(3, (1, 12))
    changed = tokens.at[:, 1].set((tokens[:, 1] + 1) % 101)
    f = nnx.jit(lambda m, t: m(t))
    assert not np.allclose(f(m, tokens)[:, 11], f(m, changed)[:, 11])                # the global layer reaches back
    local = Decoder(dataclasses.replace(cfg, global_every=0), rngs=nnx.Rngs(0))       # 3 local layers, window 3: 6 back
    np.testing.assert_allclose(f(local, tokens)[:, 11], f(local, changed)[:, 11], atol=1e-6)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_equal_the_full_forward(family, scan):
    """Prefill a left-padded batch into the stacked cache, grow it, decode one token at a time: the logits of the
    full forward, scanned and unrolled."""
    cfg = dataclasses.replace(FAMILIES[family], scan_layers=scan)
    m = Decoder(cfg, rngs=nnx.Rngs(0))
    b, t, prefill = 3, 12, 5
    tokens = _tokens(4, (b, t))
    seg = np.ones((b, t), np.int32); seg[0, :3] = 0
    pos = jnp.asarray(np.maximum(np.cumsum(seg, 1) - 1, 0).astype(np.int32)); seg = jnp.asarray(seg)
    full = nnx.jit(lambda m, t, p, s: m(t, p, s))(m, tokens, pos, seg)
    step = nnx.jit(lambda m, t, p, s, c: m(t, p, s, cache=c))
    cache = init_cache(cfg, b, 8)
    assert cache["k"].shape == (cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, 8)
    out, cache = step(m, tokens[:, :prefill], pos[:, :prefill], seg[:, :prefill], cache)
    outs = [out]
    for i in range(prefill, t):
        if i == 8: cache = grow_cache(cache, t + 1)
        out, cache = step(m, tokens[:, i:i + 1], pos[:, i:i + 1], seg[:, i:i + 1], cache)
        outs.append(out)
    got = jnp.concatenate(outs, 1)
    np.testing.assert_allclose(np.asarray(got[1:]), np.asarray(full[1:]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(got[0, 3:]), np.asarray(full[0, 3:]), atol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_decode_step_holds_one_copy_of_the_cache(num_kv_heads):
    """The compiled decode step (cache donated) needs temporaries well below the cache's size: the scan writes each
    layer's new keys into the carried stack in place rather than building a second stack."""
    cfg = get_model_config("tiny", num_layers=6, d_model=64, num_heads=2, num_kv_heads=num_kv_heads, head_dim=16,
                           mlp_dim=128, vocab_size=97)
    gd, st = nnx.split(Decoder(cfg))
    @jax.jit
    def decode(st, cache, tok):
        return nnx.merge(gd, st)(tok, jnp.broadcast_to(cache["index"], (8, 1)), jnp.ones((8, 1), jnp.int32), cache=cache)
    cache = init_cache(cfg, 8, 512)
    cache_bytes = cache["k"].nbytes + cache["v"].nbytes
    m = jax.jit(decode.__wrapped__, donate_argnums=1).lower(st, cache, jnp.ones((8, 1), jnp.int32)).compile().memory_analysis()
    # a second copy of the stack would be >= cache_bytes; one layer's written keys and values (several KV heads:
    # attention over the layer's cache with the step written in) are 2/6 of it
    assert m.temp_size_in_bytes < cache_bytes / 2, (m.temp_size_in_bytes, cache_bytes)


def _hlo_size(num_layers: int) -> int:
    cfg = get_model_config("tiny", num_layers=num_layers, d_model=64, head_dim=16, mlp_dim=128, vocab_size=97)
    gd, st = nnx.split(nnx.eval_shape(lambda: Decoder(cfg)))
    tok = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    g = jax.jit(jax.grad(lambda st, t: nnx.merge(gd, st)(t).mean()))
    return len(g.lower(st, tok).as_text())


def test_program_size_does_not_grow_with_depth():
    """The lowered gradient program of 12 layers is the size of 2 layers' (one layer traced), where a loop grows L-fold."""
    assert _hlo_size(12) < 1.05 * _hlo_size(2)
