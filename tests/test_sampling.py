"""Sampler checks: cache vs full forward, log-prob agreement, filters, recompilation, seeds, stop ids, truncation."""
import contextlib
import warnings
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.dispatch import BACKEND_COMPILE_EVENT     # "/jax/core/compile/backend_compile_duration"

from maxpost.model import create_model, get_model_config
from maxpost.sampling import (Rollout, completion_logps, filter_logits, generate, left_pad, sample_completions,
                              stop_id_array)

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model():
    return create_model(get_model_config("tiny", num_layers=2), seed=0)


_forward = nnx.jit(lambda m, x: m(x))


def full_logits(model, tokens, width=64):
    """Logits [len, V] of one unpadded sequence from a plain full forward (no cache, default positions/segments).

    The sequence starts a row of fixed `width` (one compilation); causal attention keeps the filler after it
    from changing its logits."""
    x = np.zeros((1, width), np.int32)
    x[0, :len(tokens)] = tokens
    return np.asarray(_forward(model, jnp.asarray(x))[0, :len(tokens)], np.float64)


def teacher_forced_logits(model, r: Rollout):
    "[B,T,V] logits that predicted each completion token, from the full forward of each unpadded row."
    out = []
    for p, pm, c in zip(r.prompt_ids, r.prompt_mask, r.completion_ids):
        prompt = p[pm > 0].tolist()
        out.append(full_logits(model, prompt + c.tolist())[len(prompt) - 1:len(prompt) - 1 + len(c)])
    return np.stack(out)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_filtered_log_softmax(z, top_k, top_p):
    "NumPy: keep the top_k (0: all), then the nucleus (mass strictly ahead < top_p, the first always), renormalise."
    order = np.argsort(-z, -1, kind="stable"); srt = np.take_along_axis(z, order, -1)
    rank = np.arange(z.shape[-1])
    keep = (rank < top_k) if top_k > 0 else np.ones_like(srt, bool)
    ps = np.exp(log_softmax(np.where(keep, srt, -np.inf)))
    keep = keep & ((top_p >= 1) | (np.cumsum(ps, -1) - ps < top_p) | (rank == 0))
    kept = np.full_like(z, -np.inf)
    np.put_along_axis(kept, order, np.where(keep, srt, -np.inf), -1)
    return log_softmax(kept)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.3, 20, 0.9), (1.0, 0, 0.9), (0.8, 5, 1.0)])
def test_sampler_logps_under_top_k_top_p_are_the_sampled_distributions(model, temperature, top_k, top_p):
    """Under top-k / top-p the sampler reports the log-prob of the distribution it drew from (the filtered softmax,
    renormalised over the kept tokens: issue 43 item 6), not the full softmax the loss's teacher forcing computes."""
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=10, num_generations=3,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    m = r.completion_mask > 0
    ref = np.take_along_axis(np_filtered_log_softmax(teacher_forced_logits(model, r) / temperature, top_k, top_p),
                             r.completion_ids[..., None], -1)[..., 0]
    assert np.isfinite(ref[m]).all() and np.abs(ref[m] - r.per_token_logps[m]).max() < 1e-4
    full = np.asarray(completion_logps(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                       temperature=temperature))
    assert (r.per_token_logps[m] >= full[m] - 1e-5).all() and (r.per_token_logps[m] - full[m]).max() > 1e-2


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.0, 0, 1.0)])
def test_sampler_logps_equal_teacher_forced(model, temperature, top_k, top_p):
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=10, num_generations=3,
                 temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    tf = np.asarray(completion_logps(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                     temperature=temperature))
    assert np.abs(tf - r.per_token_logps).max() < 1e-4
    # and both equal an independent NumPy log-softmax of per-row unpadded full forwards
    t = temperature if temperature > 0 else 1.0
    ref = np.take_along_axis(log_softmax(teacher_forced_logits(model, r) / t), r.completion_ids[..., None], -1)[..., 0]
    ref = np.where(r.completion_mask > 0, ref, 0.0)
    assert np.abs(ref - r.per_token_logps).max() < 1e-4


def test_greedy_equals_naive_argmax_loop(model):
    T = 8
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=T, temperature=0.0)
    for prompt, row in zip(PROMPTS, r.completion_ids):
        seq = list(prompt)
        for _ in range(T):
            seq.append(int(np.argmax(full_logits(model, seq)[-1])))
        assert row.tolist() == seq[len(prompt):]
    assert r.completion_mask.all()


def test_filter_logits_known_sets():
    z = jnp.log(jnp.array([[0.05, 0.4, 0.05, 0.3, 0.2]]))
    kept = lambda t, k, p: np.isfinite(np.asarray(filter_logits(z, t, k, p)))[0].tolist()
    assert kept(1.0, 2, 1.0) == [False, True, False, True, False]
    assert kept(1.0, 0, 0.6) == [False, True, False, True, False]
    assert kept(1.0, 0, 0.75) == [False, True, False, True, True]
    assert kept(1.0, 1, 1.0) == kept(1.0, 0, 0.01) == [False, True, False, False, False]
    # temperature changes the nucleus: at τ=0.5 the top two hold 0.16+0.09 of 0.2925 > 0.75 of the mass
    assert kept(0.5, 0, 0.75) == [False, True, False, True, False]


def test_sampled_tokens_inside_top_k_and_top_p(model):
    G, T = 16, 8
    for temperature, top_k, top_p in [(1.0, 4, 1.0), (1.5, 0, 0.5), (2.0, 10, 0.7)]:
        r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=T, num_generations=G,
                     temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
        z = teacher_forced_logits(model, r) / temperature               # [B,T,V]
        chosen = np.take_along_axis(z, r.completion_ids[..., None], -1)[..., 0]
        if top_k:
            kth = -np.sort(-z, -1)[..., top_k - 1]
            assert (chosen >= kth - 1e-4).all()
            z = np.where(z >= kth[..., None], z, -np.inf)
        if top_p < 1:
            p = np.exp(log_softmax(z))
            ahead = np.where(z > chosen[..., None] + 1e-4, p, 0.0).sum(-1)  # mass of strictly likelier tokens
            assert (ahead < top_p + 1e-4).all()
        assert len(np.unique(r.completion_ids)) > 10                    # it really sampled


def test_first_token_frequencies_match_filtered_softmax(model):
    n, temperature, top_k = 2048, 0.7, 5
    r = generate(model, [[3, 1, 4, 1, 5]], max_prompt_length=16, max_completion_length=1, num_generations=n,
                 temperature=temperature, top_k=top_k, seed=0)
    z = full_logits(model, [3, 1, 4, 1, 5])[-1] / temperature
    top = np.argsort(-z)[:top_k]
    p = np.exp(z[top] - z[top].max()); p /= p.sum()
    freq = np.array([(r.completion_ids[:, 0] == t).mean() for t in top])
    assert freq.sum() == 1.0
    assert np.abs(freq - p).max() < 4 * np.sqrt(p * (1 - p) / n).max() + 1e-3


@contextlib.contextmanager
def compiles_of(name: str):
    """Count XLA compilations of the jitted function `name` inside the block (JAX's backend-compile events).

    Counting compile events, not `sample_completions._cache_size()`: the size of the C++ dispatch cache was seen
    at -2 after `clear_cache()` when other tests had run in the same worker, and a cache entry is not a compile."""
    names = []
    def listener(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT: names.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try: yield lambda: names.count(f"jit({name})")          # JAX names the program jit(<function>)
    finally: jax.monitoring.unregister_event_duration_listener(listener)


def test_no_recompile_for_knobs_lengths_and_weights(model):
    kw = dict(max_prompt_length=64, max_completion_length=4, num_generations=2, eos_ids=[5])
    generate(model, [[1, 2], [4, 5]], temperature=1.0, **kw)         # the 16-token bucket, compiled here or before
    with compiles_of("sample_completions") as count:
        a = generate(model, [[1, 2, 3], [4, 5]], temperature=1.0, **kw)
        generate(model, [[1] * 9, [4, 5, 6, 7]], temperature=0.3, top_k=7, top_p=0.5, seed=5, **kw)
        generate(model, [[1] * 16, [4]], temperature=0.0, top_k=3, **kw)
        generate(model, [[1, 2, 3], [4, 5]], temperature=1, top_p=1, **kw)        # Python ints for floats
        generate(model, [[1, 2, 3], [4, 5]], **{**kw, "eos_ids": [5, 6, 7]})     # more stop ids, same slot count
        # new weights (what an RL update does): same program, different output
        graphdef, state = nnx.split(model)
        other = nnx.merge(graphdef, jax.tree.map(lambda x: x * 1.5, state))
        b = generate(other, [[1, 2, 3], [4, 5]], temperature=1.0, **kw)
        assert count() == 0
        assert not np.array_equal(a.per_token_logps, b.per_token_logps)
        generate(model, [[1] * 100, [4]], **{**kw, "max_prompt_length": 128})     # a bucket no other test uses
        assert count() == 1                                                    # is one new program: the count works


def test_seed_reproducible(model):
    kw = dict(max_prompt_length=32, max_completion_length=8, num_generations=2, temperature=1.0)
    a, b = generate(model, PROMPTS, seed=3, **kw), generate(model, PROMPTS, seed=3, **kw)
    c = generate(model, PROMPTS, seed=4, **kw)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_array_equal(a.per_token_logps, b.per_token_logps)
    assert not np.array_equal(a.completion_ids, c.completion_ids)
    assert not np.array_equal(a.completion_ids[0], a.completion_ids[1])      # the G samples of a prompt differ


def test_stop_ids_mask_and_padding(model):
    T, pad = 8, 0
    ref = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=T, temperature=0.0)
    stops = [int(ref.completion_ids[0, 2]), int(ref.completion_ids[1, 4])]
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=T, temperature=0.0,
                 eos_ids=stops, pad_id=pad)
    hit = 0
    for row, m, lp, full in zip(r.completion_ids, r.completion_mask, r.per_token_logps, ref.completion_ids):
        is_stop = np.isin(full, stops)
        n = int(np.argmax(is_stop)) + 1 if is_stop.any() else T                # up to and including the first stop
        hit += is_stop.any()
        assert m.tolist() == [1] * n + [0] * (T - n)
        assert row.tolist() == full[:n].tolist() + [pad] * (T - n)
        assert (lp[n:] == 0).all() and (lp[:n] < 0).all()
    assert hit >= 2 and r.completion_mask[0].sum() <= 3


def test_loop_exits_early_when_all_rows_done(model):
    ids, mask, _ = left_pad(PROMPTS, 32)
    graphdef, state = nnx.split(model)
    every_token = np.arange(model.cfg.vocab_size, dtype=np.int32)               # whatever is sampled stops
    out = sample_completions(graphdef, state, ids, mask, jax.random.key(0), np.float32(1.0), np.int32(0),
                             np.float32(1.0), every_token, np.int32(0), max_completion_length=16)
    c_ids, c_mask, logps, steps, num_kept, _ = map(np.asarray, out)
    assert int(steps) == 1 and (num_kept == 0).all()          # no top-k / top-p: no kept set to record
    assert c_mask[:, 0].all() and not c_mask[:, 1:].any() and (c_ids[:, 1:] == 0).all()


def test_left_truncation_counts_and_keeps_the_end(model):
    long1, long2 = list(range(1, 41)), list(range(100, 150))
    with pytest.warns(UserWarning, match="2 of 3 prompts"):
        r = generate(model, [long1, [7, 8], long2], max_prompt_length=24, max_completion_length=4,
                     num_generations=2, temperature=0.0)
    assert r.num_truncated_prompts == 2
    assert r.prompt_ids.shape == (6, 24)
    assert r.prompt_ids[0].tolist() == long1[-24:] and r.prompt_ids[4].tolist() == long2[-24:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = generate(model, [long1[-24:], [7, 8], long2[-24:]], max_prompt_length=24, max_completion_length=4,
                     num_generations=2, temperature=0.0)
    assert s.num_truncated_prompts == 0
    np.testing.assert_array_equal(r.completion_ids, s.completion_ids)


def test_completion_logps_gradient_matches_finite_difference(model):
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=6, temperature=0.8, seed=2)
    graphdef, state = nnx.split(model)
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)

    @jax.jit
    def f(state):
        return completion_logps(nnx.merge(graphdef, state), *args, temperature=0.8).sum()

    g = jax.grad(f)(state)
    direction = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), state)
    eps = 1e-3
    fd = (f(jax.tree.map(lambda x, d: x + eps * d, state, direction)) -
          f(jax.tree.map(lambda x, d: x - eps * d, state, direction))) / (2 * eps)
    analytic = sum(jnp.vdot(a, d) for a, d in zip(jax.tree.leaves(g), jax.tree.leaves(direction)))
    assert abs(float(fd) - float(analytic)) < 2e-2 * max(1.0, abs(float(analytic)))
    np.testing.assert_allclose(float(f(state)), r.per_token_logps.sum(), rtol=1e-5)


def test_text_decodes_up_to_and_excluding_the_stop(model):
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            assert skip_special_tokens is False
            return " ".join(map(str, ids))
    ref = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=6, temperature=0.0)
    stop = int(ref.completion_ids[0, 3])
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=6, temperature=0.0,
                 eos_ids=[stop], tokenizer=Tok())
    for row, m, text in zip(r.completion_ids, r.completion_mask, r.text):
        assert text == " ".join(str(t) for t in row[m > 0] if t != stop)
    assert r.text[0] == " ".join(map(str, ref.completion_ids[0, :ref.completion_ids[0].tolist().index(stop)]))


def test_misuse_raises(model):
    with pytest.raises(ValueError):
        generate(model, [[1], []], max_prompt_length=8, max_completion_length=2)
    with pytest.raises(ValueError):
        generate(model, [[1]], max_prompt_length=8, max_completion_length=2, temperature=-1.0)
    assert stop_id_array([1, 2]).shape == (8,)


def test_sharded_model_samples_like_unsharded(model):
    from maxpost.sharding import make_mesh
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = create_model(model.cfg, seed=0, mesh=mesh)
    kw = dict(max_prompt_length=32, max_completion_length=6, num_generations=2, temperature=0.0)
    ref = generate(model, PROMPTS, **kw)
    with jax.set_mesh(mesh):
        r = generate(sharded, PROMPTS, **kw)
    np.testing.assert_array_equal(r.completion_ids, ref.completion_ids)
    np.testing.assert_allclose(r.per_token_logps, ref.per_token_logps, atol=1e-4)


@pytest.mark.parametrize("axes", [dict(), dict(data=2, fsdp=2, tensor=2)])
def test_shared_prompt_logps_under_a_mesh(model, axes):
    """num_generations=G runs each prompt once; under a mesh it does so only when the distinct prompts split over the
    devices as the rows do (each device repeats its own groups' caches), and either way gives the plain path's log-probs."""
    from maxpost.sharding import make_mesh, shard_batch
    from maxpost.sampling import _share_prompts
    mesh = make_mesh(**axes)
    sharded = create_model(model.cfg, seed=0, mesh=mesh)
    graphdef, state = nnx.split(sharded)
    f = jax.jit(lambda st, b, g: completion_logps(nnx.merge(graphdef, st), b["prompt_ids"], b["prompt_mask"],
                                                  b["completion_ids"], b["completion_mask"], 0.8, g), static_argnums=2)
    for prompts, g, shared in [(PROMPTS * 2, 2, True), (PROMPTS[:2], 4, False)]:    # 8 or 2 distinct prompts
        r = generate(model, prompts, max_prompt_length=32, max_completion_length=6, num_generations=g,
                     temperature=0.8, seed=1)
        b = shard_batch(dict(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask, completion_ids=r.completion_ids,
                             completion_mask=r.completion_mask), mesh)
        with jax.set_mesh(mesh):
            assert _share_prompts(sharded, len(r.prompt_ids), g) == shared
            got, plain = np.asarray(f(state, b, g)), np.asarray(f(state, b, 1))
        np.testing.assert_allclose(got, plain, atol=1e-5)
        np.testing.assert_allclose(got, r.per_token_logps, atol=1e-4)


# ---- chunked log-probs and entropy; the draw distribution at scale

from maxpost.sampling import chunked_logps, draw_categorical, scaled_entropy


@pytest.mark.parametrize("tie,g", [(True, 3), (False, 1)])
def test_chunked_completion_logps_equal_logits_path(tie, g):
    """completion_logps by chunks (default on) == from the whole logits (plain path): log-probs, entropy and the
    gradients of a weighted sum of both w.r.t. every parameter, fp32, tied and untied heads, shared-prompt (G = 3) and
    plain batches, chunks that do not divide the completion (7 tokens of 6 rows, 2 positions a chunk: 4 chunks, the
    last ragged)."""
    m = create_model(get_model_config("tiny", num_layers=2, d_model=32, head_dim=16, mlp_dim=64, tie_embeddings=tie), seed=4)
    r = generate(m, PROMPTS[:2], max_prompt_length=16, max_completion_length=7, num_generations=3, temperature=0.9, seed=5)
    rng = np.random.default_rng(0)
    wl, we = (jnp.asarray(rng.normal(size=r.completion_ids.shape), jnp.float32) for _ in range(2))
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.9)
    def run(g, chunk):
        f = lambda m: completion_logps(m, *args, g, chunk_size=chunk, with_entropy=True)
        out = nnx.jit(f)(m)
        def weighted(m):
            lp, ent = f(m)
            return (lp * wl + ent * we).sum()
        grads = nnx.jit(nnx.grad(weighted))(m)
        return out, jax.tree.leaves(nnx.state(grads))
    (ref, ref_g) = run(1, None)
    np.testing.assert_allclose(np.asarray(ref[0]), r.per_token_logps, atol=1e-4)
    for chunk in (12,):
        (lp, ent), grads = run(g, chunk)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ref[0]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(ref[1]), atol=1e-5)
        for a, b in zip(grads, ref_g):                     # sums over 42 tokens of O(1) terms: 1e-5 relative too
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_entropy_matches_numpy(model):
    "The entropy completion_logps returns is -sum p log p of softmax(logits / T) from per-row full forwards (NumPy)."
    r = generate(model, PROMPTS, max_prompt_length=32, max_completion_length=5, temperature=0.7, seed=6)
    _, ent = completion_logps(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.7,
                              with_entropy=True)
    lp = log_softmax(teacher_forced_logits(model, r) / 0.7)
    ref = np.where(r.completion_mask > 0, -(np.exp(lp) * lp).sum(-1), 0.0)
    np.testing.assert_allclose(np.asarray(ent), ref, atol=1e-4)


def test_chunked_logps_temperature_zero_counts_as_one():
    h = jax.random.normal(jax.random.key(0), (2, 3, 4)); w = jax.random.normal(jax.random.key(1), (9, 4))
    tok = jnp.array([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_allclose(np.asarray(chunked_logps(h, w, tok, 0.0, chunk_size=2)),
                               np.asarray(chunked_logps(h, w, tok, 1.0, chunk_size=2)))
    np.testing.assert_allclose(np.asarray(scaled_entropy(h @ w.T, 0.0)), np.asarray(scaled_entropy(h @ w.T, 1.0)))


def test_draw_categorical_chi_square():
    """200,000 draws on a vocabulary that is not a multiple of the block width (1,000 = 31 blocks of 32 + 8), removed
    tokens at block edges and a whole removed block: never a removed token, and a chi-square test of the counts
    against N p_v (its p-value is uniform when the sampler is right, tiny when not)."""
    import scipy.stats
    V, N = 1000, 200_000
    zv = np.array(jax.random.normal(jax.random.key(7), (V,)), np.float64) * 1.5
    zv[[0, 31, 32, 63, 999]] = -np.inf; zv[64:96] = -np.inf
    pv = np.exp(zv - zv.max()); pv /= pv.sum()
    drawn = np.asarray(jax.jit(draw_categorical)(jax.random.key(0), jnp.tile(jnp.asarray(zv, jnp.float32), (N, 1))))
    counts = np.bincount(drawn, minlength=V)
    assert counts[pv == 0].sum() == 0
    big = N * pv >= 5                        # pool the rare tokens into one bin (chi-square needs >= 5 expected)
    obs = np.append(counts[big], counts[~big].sum()); exp = np.append(N * pv[big], N * pv[~big].sum())
    assert scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
