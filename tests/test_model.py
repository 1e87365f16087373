"""Decoder behaviour across families: packing, KV cache, dtypes, sharded init, presets, RoPE vs transformers."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from maxpost.model import (ModelConfig, Decoder, PRESETS, get_model_config, create_model, init_cache, with_tail, num_params,
                           rope_frequencies, attention_mask)
from maxpost.sharding import make_mesh

SMALL = dict(vocab_size=101, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)
FAMILIES = {
    "llama": ModelConfig(family="llama", num_layers=2, **SMALL, tie_embeddings=False, norm_eps=1e-5,
                         rope_theta=10_000.0, rope_type="llama3", rope_factor=8.0, rope_original_max_len=16),
    "qwen3": ModelConfig(family="qwen3", num_layers=2, **SMALL, qk_norm=True, rope_theta=1e6),
    "gemma3": ModelConfig(family="gemma3", num_layers=4, **SMALL, sliding_window=3, global_every=3, qk_norm=True,
                          rope_theta=1e6, local_rope_theta=1e4, query_pre_attn_scalar=24.0,
                          activation="gelu_tanh", embed_scale=True, norm_plus_one=True, post_norms=True),
}

fwd = nnx.jit(lambda m, t, p=None, s=None: m(t, p, s))
step = nnx.jit(lambda m, t, p, s, c: m(t, p, s, cache=c))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    m = Decoder(FAMILIES[request.param], rngs=nnx.Rngs(0))
    # non-trivial norm weights, so qk-norm and (1+w) are exercised
    for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        if path[-1] == "scale":
            v.set_value(v.get_value() + 0.3 * jax.random.normal(jax.random.key(hash(path) % 2**31), v.shape))
    return m


def _tokens(seed, shape, vocab=101):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape))


def test_packed_equals_separate(model):
    """Three sequences packed in one row (positions restart, segment ids 1,2,3, 2 pads) = each run alone."""
    lengths = [7, 9, 5]
    seqs = [_tokens(i, (1, n)) for i, n in enumerate(lengths)]
    tokens = jnp.concatenate(seqs + [jnp.zeros((1, 2), jnp.int32)], axis=1)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths] + [np.zeros(2)])[None].astype(np.int32))
    seg = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(2)])[None].astype(np.int32))
    packed = np.asarray(fwd(model, tokens, pos, seg))
    start = 0
    for s, n in zip(seqs, lengths):
        alone = np.asarray(fwd(model, s))
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=1e-4, rtol=0)
        start += n
    assert np.isfinite(packed).all()


def test_segments_isolated(model):
    """Changing every token of segment 1 leaves segment 2's logits unchanged."""
    tokens = _tokens(10, (1, 12))
    seg = jnp.asarray([[1] * 6 + [2] * 6]); pos = jnp.asarray([list(range(6)) * 2])
    a = fwd(model, tokens, pos, seg)
    b = fwd(model, tokens.at[:, :6].set((tokens[:, :6] + 1) % 101), pos, seg)
    assert not np.allclose(a[:, :6], b[:, :6])
    np.testing.assert_allclose(a[:, 6:], b[:, 6:], atol=1e-6)


@pytest.mark.parametrize("prefill", [1, 6])
def test_kv_cache_equals_full_forward(model, prefill):
    """Prefill a left-padded batch (pads: segment 0), decode token by token: logits = the full forward's."""
    b, t = 3, 14
    tokens = _tokens(20, (b, t))
    seg = np.ones((b, t), np.int32); seg[0, :4] = 0; seg[2, :1] = 0
    pos = np.maximum(np.cumsum(seg, 1) - 1, 0).astype(np.int32)
    full = np.asarray(fwd(model, tokens, jnp.asarray(pos), jnp.asarray(seg)))
    cache = init_cache(model.cfg, b, t + 3)
    outs = []
    out, cache = step(model, tokens[:, :prefill], jnp.asarray(pos[:, :prefill]), jnp.asarray(seg[:, :prefill]), cache)
    outs.append(out)
    for i in range(prefill, t):
        out, cache = step(model, tokens[:, i:i + 1], jnp.asarray(pos[:, i:i + 1]), jnp.asarray(seg[:, i:i + 1]), cache)
        outs.append(out)
    got = np.asarray(jnp.concatenate(outs, axis=1))
    real = seg.astype(bool)
    assert np.abs(got[real] - full[real]).max() < 1e-4
    assert int(cache["index"]) == t
    np.testing.assert_array_equal(np.asarray(cache["segment_ids"])[:, :t], seg)
    assert (np.asarray(cache["segment_ids"])[:, t:] == 0).all()


def test_kv_cache_left_padding_equals_unpadded(model):
    """A left-padded row decodes to the same logits as the same prompt without padding."""
    prompt = _tokens(30, (1, 6)); cont = _tokens(31, (1, 4))
    alone = np.asarray(fwd(model, jnp.concatenate([prompt, cont], 1)))
    tokens = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), prompt], 1)
    seg = jnp.asarray([[0] * 3 + [1] * 6]); pos = jnp.asarray([[0] * 3 + list(range(6))])
    cache = init_cache(model.cfg, 1, 16)
    out, cache = step(model, tokens, pos, seg, cache)
    outs = [out[:, 3:]]
    for i in range(4):
        out, cache = step(model, cont[:, i:i + 1], jnp.asarray([[6 + i]]), jnp.asarray([[1]]), cache)
        outs.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), alone, atol=1e-4, rtol=0)


def test_bf16_close_to_fp32(model):
    """bf16 params + compute: fp32 logits, finite, loosely close to the fp32 model's."""
    cfg16 = dataclasses.replace(model.cfg, dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = nnx.split(model)
    m16 = nnx.merge(nnx.split(Decoder(cfg16, rngs=nnx.Rngs(0)))[0],
                    jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    assert m16.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    tokens = _tokens(40, (2, 16))
    ref, got = np.asarray(fwd(model, tokens)), np.asarray(fwd(m16, tokens))
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 0.05
    # bf16 compute with fp32 params also runs and agrees loosely
    m_mixed = nnx.merge(nnx.split(Decoder(dataclasses.replace(model.cfg, dtype="bfloat16"), rngs=nnx.Rngs(0)))[0], state)
    assert np.abs(np.asarray(fwd(m_mixed, tokens)) - ref).max() < 0.05 * np.abs(ref).max() + 0.05


def test_causal(model):
    """Future tokens never change earlier logits."""
    tokens = _tokens(50, (2, 10))
    a, b = fwd(model, tokens), fwd(model, tokens.at[:, 7:].set(0))
    np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-6)


def test_sliding_window_reach():
    """Gemma-style: with only local layers (window W, L layers) a token more than L*(W-1) back has no effect."""
    cfg = dataclasses.replace(FAMILIES["gemma3"], global_every=0)            # all local, W=3, 4 layers
    m = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(60, (1, 12))
    changed = tokens.at[:, 2].set((tokens[:, 2] + 1) % 101)
    a, b = fwd(m, tokens), fwd(m, changed)
    np.testing.assert_allclose(a[:, 11], b[:, 11], atol=1e-6)              # 9 back > 4*2: unreachable
    assert not np.allclose(a[:, 10], b[:, 10])                              # 8 back = 4*2: reachable


def test_create_model_on_mesh():
    """create_model(mesh=...) makes each weight in its logical shards and equals the unsharded init."""
    cfg = FAMILIES["qwen3"]
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded, plain = create_model(cfg, seed=3, mesh=mesh), create_model(cfg, seed=3)
    for path, v in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        names = v.get_metadata()["out_sharding"]
        assert len(names) == v.get_value().ndim, path
    assert sharded.layers.attn.k_proj[...].sharding.spec == jax.P(None, "fsdp", "tensor", None)   # layers: unsharded
    assert sharded.layers.mlp.down_proj[...].sharding.spec == jax.P(None, "tensor", "fsdp")
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(plain))):
        assert p1 == p2
        np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), rtol=1e-6, atol=1e-7)
    tokens = _tokens(70, (4, 8))
    with jax.set_mesh(mesh):
        got = fwd(sharded, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(fwd(plain, tokens)), atol=1e-5)


def test_gradients_flow(model):
    """Every parameter gets a finite gradient, and the gradient of one entry matches a finite difference."""
    tokens = _tokens(80, (2, 8))

    def loss(m):
        logp = jax.nn.log_softmax(m(tokens[:, :-1]))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    grads = nnx.grad(loss)(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert sum(float(jnp.abs(g).sum() > 0) for g in leaves) == len(leaves)
    w = model.layers[0].mlp.up_proj
    g = float(grads.layers.mlp.up_proj[...][0, 3, 5])          # layer 0 of the stacked gradient
    orig, eps = w.get_value(), 1e-2
    w.set_value(orig.at[3, 5].add(eps)); up = float(loss(model))
    w.set_value(orig.at[3, 5].add(-eps)); down = float(loss(model))
    w.set_value(orig)
    assert abs((up - down) / (2 * eps) - g) < 1e-3 + 1e-2 * abs(g)


# published parameter counts (text weights; tied embeddings counted once)
KNOWN = {"llama3.1-8b": 8.03e9, "llama3.2-1b": 1.236e9, "qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.72e9,
         "qwen3-4b": 4.02e9, "gemma3-1b": 1.0e9, "gemma3-4b": 3.88e9}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_preset_param_counts(name):
    """Presets (eval_shape only) have the published number of parameters (within 2%)."""
    assert abs(num_params(PRESETS[name]) - KNOWN[name]) < 0.02 * KNOWN[name]


def test_tiny_preset_matches_contract():
    cfg = get_model_config("tiny")
    assert (cfg.family, cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.mlp_dim, cfg.tie_embeddings, cfg.rope_theta) == ("qwen3", 512, 128, 4, 2, 1, 64, 512, True, 10_000.0)


def test_rope_frequencies_match_transformers():
    """llama3 and linear scaled inverse frequencies equal transformers' rope init functions."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=dict(
        rope_type="llama3", rope_theta=500_000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_frequencies(64, 500_000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6)
    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128,
                                   rope_parameters=dict(rope_type="linear", rope_theta=1e6, factor=8.0))
    inv, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    np.testing.assert_allclose(rope_frequencies(128, 1e6, "linear", 8.0), inv.numpy(), rtol=1e-6)


def test_attention_mask_naive():
    """attention_mask equals a double loop over the rule (same non-zero segment, causal, window)."""
    rng = np.random.default_rng(0)
    seg = rng.integers(0, 3, (2, 9)); pos = rng.integers(0, 6, (2, 9))
    for window in (None, 2):
        got = np.asarray(attention_mask(jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg), window))
        for b in range(2):
            for t in range(9):
                for s in range(9):
                    ok = seg[b, t] == seg[b, s] != 0 and pos[b, s] <= pos[b, t]
                    ok = ok and (window is None or pos[b, t] - pos[b, s] < window)
                    assert got[b, t, s] == ok


def test_tunix_qwen3_through_adapter(tmp_path):
    """A tiny HF Qwen3 loaded by Tunix's own loader, wrapped in TunixPolicy, gives maxpost's logits (incl. packing)."""
    import torch, transformers
    import tunix.models.qwen3.model as tq, tunix.models.qwen3.params as tparams
    from maxpost.checkpoint import load_hf
    from maxpost.model import TunixPolicy
    hf_cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, vocab_size=128, intermediate_size=96, tie_word_embeddings=True,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e6))
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp_path, safe_serialization=True)
    tcfg = tq.ModelConfig(num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=96, num_heads=4, head_dim=16,
                          num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True)
    policy = TunixPolicy(tparams.create_model_from_safe_tensors(str(tmp_path), tcfg))
    ours = load_hf(tmp_path)
    tokens = _tokens(90, (2, 12), vocab=128)
    diff = np.abs(np.asarray(policy(tokens)) - np.asarray(ours(tokens))).max()
    print(f"tunix adapter vs maxpost: {diff:.2e}")
    assert diff < 1e-4
    seg = jnp.asarray([[1] * 5 + [2] * 7] * 2); pos = jnp.asarray([list(range(5)) + list(range(7))] * 2)
    np.testing.assert_allclose(np.asarray(policy(tokens, pos, seg)), np.asarray(ours(tokens, pos, seg)), atol=1e-4)


# ---- attention: blockwise vs the naive masked softmax, kernels, sharding, the decode loop's copies

from maxpost.model import Spans, attend, blockwise_attention


def _naive_mask(qpos, qseg, kpos, kseg, window=None, causal=False):
    "The mask rule as a loop (NumPy): same non-zero segment, causal by position, window; by index too when causal."
    b, t = qpos.shape; s = kpos.shape[1]
    m = np.zeros((b, t, s), bool)
    for i in range(b):
        for a in range(t):
            for c in range(s):
                ok = qseg[i, a] == kseg[i, c] != 0 and kpos[i, c] <= qpos[i, a]
                ok = ok and (window is None or qpos[i, a] - kpos[i, c] < window) and (not causal or c <= a)
                m[i, a, c] = ok
    return m


def _softmax_attention(q, k_bkhs, v_bksh, mask, scale):
    "Reference: repeat kv heads, one masked softmax over all keys (float32); rows that see nothing give 0."
    g = q.shape[2] // k_bkhs.shape[1]
    k = jnp.repeat(k_bkhs, g, 1); v = jnp.repeat(v_bksh, g, 1)                  # [B,N,H,S], [B,N,S,H]
    s = jnp.einsum("btnh,bnhs->bnts", q, k) * scale
    s = jnp.where(mask[:, None], s, -jnp.inf)
    p = jnp.where(mask[:, None], jnp.exp(s - jnp.max(jnp.where(mask[:, None], s, -1e30), -1, keepdims=True)), 0.0)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bnts,bnsh->btnh", p, v)


def _qkv(seed, b, t, s, n, k, h):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, t, n, h)), jax.random.normal(ks[1], (b, k, h, s)),
            jax.random.normal(ks[2], (b, k, s, h)), jax.random.normal(ks[3], (b, t, n, h)))


def _packed_spans(b, t, seed):
    "Rows of 1-3 packed segments with restarting positions, some with left or right padding."
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32); pos = np.zeros((b, t), np.int32)
    for i in range(b):
        lead = int(rng.integers(0, 4)) if i % 2 else 0
        cuts = np.sort(rng.choice(np.arange(lead + 1, t), size=int(rng.integers(1, 3)), replace=False))
        start, sid = lead, 1
        for c in [*cuts, t - (i % 3)]:
            seg[i, start:c] = sid; pos[i, start:c] = np.arange(c - start); start, sid = c, sid + 1
    return pos, seg


ATTENTION_CASES = {
    # name: (b, t, n, k, h, window, causal, block_q, block_kv)
    "causal_packed_gqa": (3, 37, 6, 2, 8, None, True, 8, 8),
    "causal_mqa_window": (2, 29, 4, 1, 8, 5, True, 8, 8),
    "not_causal_window": (2, 23, 4, 2, 8, 7, False, 8, 8),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_blockwise_equals_naive_softmax(case):
    """Values and gradients (q, k, v) of the blockwise attention equal one masked softmax over all keys."""
    b, t, n, k, h, window, causal, bq, bk = ATTENTION_CASES[case]
    q, kk, v, w = _qkv(1, b, t, t, n, k, h)
    pos, seg = _packed_spans(b, t, 2)
    mask = jnp.asarray(_naive_mask(pos, seg, pos, seg, window, causal))
    sp = Spans(*map(jnp.asarray, (pos, seg, pos, seg)))
    seen = mask.any(-1)[:, :, None, None]
    f = lambda q, k, v: blockwise_attention(q, k, v, sp, 0.35, window=window, causal=causal, block_q=bq, block_kv=bk)
    r = lambda q, k, v: _softmax_attention(q, k, v, mask, 0.35)
    vg = lambda g: jax.jit(jax.value_and_grad(lambda q, k, v: (g(q, k, v) * w * seen).sum(), (0, 1, 2)))(q, kk, v)
    (lf, gf), (lr, gr) = vg(f), vg(r)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, kk, v) * seen), np.asarray(r(q, kk, v) * seen), atol=1e-5)
    np.testing.assert_allclose(float(lf), float(lr), rtol=1e-5)
    for a, c in zip(gf, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)
    assert (np.asarray(jax.jit(f)(q, kk, v))[~np.asarray(seen[..., 0, 0])] == 0).all()   # a query that sees nothing: 0


def test_blockwise_over_a_kv_cache():
    """Prefill (5 queries) and decode (1 query) over a 19-slot cache with empty slots, left padding and a window."""
    b, s, n, k, h = 2, 19, 4, 2, 8
    kseg = np.zeros((b, s), np.int32); kseg[0, :14] = 1; kseg[1, 3:14] = 1            # row 1 left-padded
    kpos = np.maximum(np.cumsum(kseg, 1) - 1, 0).astype(np.int32)
    for t, window in [(5, 4), (1, 3)]:                                     # prefill, decode (no window: 02_model)
        q, kk, v, w = _qkv(3 + t, b, t, s, n, k, h)
        qpos, qseg = kpos[:, 14 - t:14], kseg[:, 14 - t:14]
        mask = jnp.asarray(_naive_mask(qpos, qseg, kpos, kseg, window))
        sp = Spans(*map(jnp.asarray, (qpos, qseg, kpos, kseg)))
        f = lambda q, k, v: attend(q, k, v, sp, 0.3, window=window)
        r = lambda q, k, v: _softmax_attention(q, k, v, mask, 0.3)
        np.testing.assert_allclose(np.asarray(jax.jit(f)(q, kk, v)), np.asarray(r(q, kk, v)), atol=1e-5)
        gf = jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), (0, 1, 2)))(q, kk, v)
        gr = jax.grad(lambda *a: (r(*a) * w).sum(), (0, 1, 2))(q, kk, v)
        for a, c in zip(gf, gr):
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_kernels_equal_blockwise_where_they_fit(impl):
    """`attend` with jax.nn.dot_product_attention (its xla reference, called as the GPU path calls cuDNN) or Splash
    (Pallas interpret mode) equals the blockwise attention, values and gradients; batches a kernel cannot express
    (packed for cuDNN; a revisited segment for Splash) take the blockwise path and are still right."""
    b, t, n, k, h = 2, 128, 4, 2, 16
    q, kk, v, w = _qkv(11, b, t, t, n, k, h)
    fits_seg = np.ones((b, t), np.int32); fits_seg[1, 100:] = 0                   # one sequence per row, right padding
    fits_pos = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
    cases = [(fits_pos, fits_seg, 1)]
    if impl == "splash":                                                        # splash also takes packed, left-padded rows
        pos, seg = _packed_spans(b, t, 4); cases.append((pos, seg, 1))
    seg = fits_seg.copy(); seg[0, 60:] = 2; seg[0, 90:] = 1                     # segment 1 comes back: blockwise
    pos = fits_pos.copy(); pos[0, 60:90] = np.arange(30); pos[0, 90:] = np.arange(60, 98)
    cases.append((pos, seg, 0))
    for c, (pos, seg, fits) in enumerate(cases):
        sp = Spans(*map(jnp.asarray, (pos, seg, pos, seg)))
        real = jnp.asarray(seg != 0)[:, :, None, None]
        from maxpost.attention import _one_sequence_rows, _contiguous_segments
        assert bool((_contiguous_segments if impl == "splash" else _one_sequence_rows)(sp)) == bool(fits)
        for window in [(None, 16)[c % 2]]:                                     # with and without a window, in turn
            vg = lambda i: jax.jit(jax.value_and_grad(lambda q, k, v: (attend(q, k, v, sp, 0.25, window=window, causal=True,
                                                                             implementation=i) * w * real).sum(), (0, 1, 2)))(q, kk, v)
            (lk, gk), (lb, gb) = vg(impl), vg("blockwise")
            np.testing.assert_allclose(float(lk), float(lb), rtol=1e-5, atol=1e-5)
            for a, c in zip(gk, gb):
                np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=2e-5)


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_attention_on_8_devices_equals_1(impl):
    """On a mesh with data, fsdp and tensor axes (batch and heads split), the attention and its gradients equal the
    single-device numbers."""
    b, t, n, k, h = 4, 128, 4, 2, 16
    q, kk, v, w = _qkv(13, b, t, t, n, k, h)
    pos, seg = _packed_spans(b, t, 5)
    sp = Spans(*map(jnp.asarray, (pos, seg, pos, seg)))
    real = jnp.asarray(seg != 0)[:, :, None, None]
    f = lambda q, k, v: (attend(q, k, v, sp, 0.25, window=24, causal=True, implementation=impl) * w * real).sum()
    ref = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, kk, v)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    put = lambda x, names: jax.device_put(x, jax.NamedSharding(mesh, jax.P(*names)))
    with jax.set_mesh(mesh):
        args = (put(q, (("data", "fsdp"), None, "tensor", None)), put(kk, (("data", "fsdp"), "tensor", None, None)),
                put(v, (("data", "fsdp"), "tensor", None, None)))
        got = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(*args)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=2e-5)


def test_decoder_on_8_devices_equals_1():
    """The whole decoder (blockwise attention inside) on a data x fsdp x tensor mesh: same loss and gradients."""
    cfg = dataclasses.replace(FAMILIES["gemma3"], num_layers=3)          # local, local, global
    tokens = _tokens(95, (4, 40))
    pos, seg = _packed_spans(4, 40, 6)
    def loss(m):
        logp = jax.nn.log_softmax(m(tokens, jnp.asarray(pos), jnp.asarray(seg))[:, :-1])
        return -(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0] * (seg[:, 1:] != 0)).mean()
    ref = nnx.jit(nnx.value_and_grad(loss))(create_model(cfg, seed=1))
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        got = nnx.jit(nnx.value_and_grad(loss))(create_model(cfg, seed=1, mesh=mesh))
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
    for a, c in zip(jax.tree.leaves(nnx.state(got[1])), jax.tree.leaves(nnx.state(ref[1]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)


def _cache_copies_in_decode_loop(cfg, tail: bool = False) -> int:
    "Copies of a stacked cache array in the loops of a compiled loop of decode steps (the steps' loop and the layers' scan in it); `tail`: the steps write into a tail (`with_tail`), whose arrays count too."
    import re
    gd, st = nnx.split(Decoder(cfg))
    @jax.jit
    def decode(st, cache):
        model = nnx.merge(gd, st)
        def body(i, c):
            tok, cache = c
            pos = jnp.broadcast_to(cache["index"], (4, 1))
            logits, cache = model(tok, pos, jnp.ones((4, 1), jnp.int32), cache=cache)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, 3, body, (jnp.ones((4, 1), jnp.int32), cache))
    cache = init_cache(cfg, 4, 8)
    if tail: cache = with_tail(cache, 3)
    hlo = decode.lower(st, cache).compile().as_text()
    assert "while(" in hlo
    stacks = [cache[n] for n in ("k", "v", "k_tail", "v_tail") if n in cache]      # the stacks of every layer
    shapes = {f"f32[{','.join(map(str, x.shape))}]" for x in stacks}
    n, in_loops = 0, False
    for line in hlo.splitlines():
        if line and not line.startswith(" "): in_loops = not line.startswith("ENTRY")   # ENTRY copies the (not donated) input
        n += in_loops and " copy(" in line and any(s in line.split("=", 1)[1] for s in shapes)
    return n


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_decode_loop_writes_the_cache_in_place(num_kv_heads, tail):
    """A loop of decode steps writes every layer's cache in place: no copy of a stacked cache array in either loop (with
    one KV head the plain read-after-write path copied each array twice a step on XLA:CPU; see `attend_step`)."""
    cfg = get_model_config("tiny", num_layers=2, d_model=64, num_heads=2, num_kv_heads=num_kv_heads, head_dim=16,
                           mlp_dim=128, vocab_size=97)
    assert _cache_copies_in_decode_loop(cfg, tail) == 0
