"""maxpost.sampler_correction against NumPy re-implementations of TRL's four importance-sampling modes (as TRL's
GRPOTrainer documents and computes them) and of the decoupled PPO loss with truncated token weights (verl's TIS /
AReaL's decoupled objective), on identical tensors."""
import jax, jax.numpy as jnp, numpy as np, pytest

from maxpost.policy_loss import policy_loss
from maxpost.sampler_correction import importance_weights, IMPORTANCE_SAMPLING_MODES


def _trl_weights(old, sampler, mask, mode, cmax, cmin):
    "TRL's recipe, in float64: d = (old - sampler) * mask with NaN -> 0; summed per row for sequence modes; exp; clamp or zero outside the bounds."
    d = np.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"): d = d.sum(-1, keepdims=True)
    r = np.exp(d)
    lo = -np.inf if cmin is None else cmin
    hi = np.inf if cmax is None else cmax
    r = np.clip(r, lo, hi) if mode.endswith("truncate") else np.where((r < lo) | (r > hi), 0.0, r)
    return np.broadcast_to(r, old.shape)


def _tensors(seed, B=6, T=9, sigma=0.4):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.7, (B, T))
    sampler = old + rng.normal(0, sigma, (B, T))
    sampler[0, 2] = np.nan                                   # a token the engine could not score
    mask = (np.arange(T)[None] < rng.integers(1, T + 1, (B, 1))).astype(np.float32)
    mask[0, :3] = 1
    return old, sampler, mask


@pytest.mark.parametrize("mode", [m for m in IMPORTANCE_SAMPLING_MODES if m != "none"])
@pytest.mark.parametrize("cmax,cmin", [(3.0, None), (2.0, 0.5), (1.2, 0.9)])
def test_weights_equal_trls_recipe(mode, cmax, cmin):
    old, sampler, mask = _tensors(0)
    ours, _ = importance_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), mode, cmax, cmin)
    ref = _trl_weights(old, sampler, mask, mode, cmax, cmin)
    valid = mask > 0
    np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], rtol=1e-5)


def test_metrics_are_trls():
    "sampling_logp_difference over scored tokens (NaN excluded); ratio min/mean/max over tokens (token modes) or sequences."
    old, sampler, mask = _tensors(1, sigma=0.2)
    known = (mask > 0) & ~np.isnan(sampler)
    delta = np.abs(old - sampler)[known]
    for mode in ("token_truncate", "sequence_mask"):
        _, m = importance_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), mode, 3.0)
        np.testing.assert_allclose(float(m["sampling/sampling_logp_difference/mean"]), delta.mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m["sampling/sampling_logp_difference/max"]), delta.max(), rtol=1e-5)
        r = _trl_weights(old, sampler, mask, mode, 3.0, None)
        flat = r[:, 0] if mode.startswith("sequence") else r[mask > 0]
        for k, f in (("min", np.min), ("mean", np.mean), ("max", np.max)):
            np.testing.assert_allclose(float(m[f"sampling/importance_sampling_ratio/{k}"]), f(flat), rtol=1e-5)


def test_a_healthy_sampler_shows_a_small_difference_and_stale_weights_a_large_one():
    """The metric tells the two apart: an engine whose log-probs differ by rounding (sigma 0.01) against a sampler one
    update stale (sigma 0.2): TRL's issue 5312 saw 0.010-0.018 healthy and 0.201 with the stale-weights bug."""
    small = importance_weights(*[jnp.asarray(x) for x in _tensors(2, sigma=0.015)], "token_truncate")[1]
    large = importance_weights(*[jnp.asarray(x) for x in _tensors(2, sigma=0.25)], "token_truncate")[1]
    assert float(small["sampling/sampling_logp_difference/mean"]) < 0.02 < 0.15 < float(large["sampling/sampling_logp_difference/mean"])


def test_decoupled_loss_equals_the_formula():
    """verl / AReaL decoupled PPO: ratio pi_theta / pi_prox clipped, times min(pi_prox / mu, C) with no gradient,
    token-mean: maxpost's policy_loss with token_truncate weights gives the same value and gradient."""
    rng = np.random.default_rng(4)
    B, T, C = 5, 7, 2.0
    prox = rng.normal(-1.2, 0.5, (B, T)); mu = prox + rng.normal(0, 0.5, (B, T))
    lp = prox + rng.normal(0, 0.15, (B, T)); adv = rng.normal(size=B)
    mask = (rng.random((B, T)) < 0.85).astype(np.float32); mask[:, 0] = 1

    def naive(lp):
        r = jnp.exp(lp - prox)
        w = np.minimum(np.exp(prox - mu), C)
        term = jnp.maximum(-adv[:, None] * r, -adv[:, None] * jnp.clip(r, 0.8, 1.28)) * w
        return (term * mask).sum() / mask.sum()

    w, _ = importance_weights(jnp.asarray(prox), jnp.asarray(mu), jnp.asarray(mask), "token_truncate", clip_max=C)
    ours = lambda lp: policy_loss(lp, jnp.asarray(prox), None, jnp.asarray(adv), jnp.asarray(mask), importance_weights=w)[0]
    np.testing.assert_allclose(float(ours(jnp.asarray(lp))), float(naive(jnp.asarray(lp))), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(jnp.asarray(lp))), np.asarray(jax.grad(naive)(jnp.asarray(lp))),
                               rtol=1e-4, atol=1e-7)


def test_the_weights_carry_no_gradient():
    old, sampler, mask = _tensors(5)
    for mode in IMPORTANCE_SAMPLING_MODES:
        g = jax.grad(lambda o: importance_weights(o, jnp.asarray(sampler), jnp.asarray(mask), mode)[0].sum())(jnp.asarray(old))
        assert not np.asarray(g).any(), mode


@pytest.mark.parametrize("n", [3, 40])
def test_sequence_weights_are_products_of_token_weights(n):
    """A sequence mode's weight is the product over the completion's tokens of e^d (summed in log space): equal to
    numpy's product of the token weights, truncated or masked as a whole at C_max; padding contributes nothing."""
    rng = np.random.default_rng(n)
    d = rng.normal(0, 0.08, (6, n)); d[:, 0] += np.linspace(-1.5, 1.5, 6)          # some rows past C = 3
    mask = np.ones((6, n), np.float32); mask[1, n // 2:] = 0
    d[1, n // 2:] = 50.0                                                              # padding: ignored
    prod = np.prod(np.where(mask > 0, np.exp(d), 1.0), axis=-1)
    args = (jnp.asarray(d), jnp.zeros((6, n)), jnp.asarray(mask))
    trunc = np.asarray(importance_weights(*args, "sequence_truncate", clip_max=3.0)[0])
    masked = np.asarray(importance_weights(*args, "sequence_mask", clip_max=3.0)[0])
    np.testing.assert_allclose(trunc[:, 0], np.minimum(prod, 3.0), rtol=1e-5)
    np.testing.assert_allclose(masked[:, 0], np.where(prod > 3.0, 0.0, prod), rtol=1e-5)
    assert (prod > 3.0).any() and (prod <= 3.0).any()
    assert (trunc == trunc[:, :1]).all() and (masked == masked[:, :1]).all()       # one weight for every token


def test_token_truncate_is_tunixs_sampler_is_token():
    """Tunix's agentic GRPO learner (`sampler_is="token"`, `sampler_is_threshold`, default 2.0) weights each token by
    min(exp(clip(trainer - sampler, -20, 20)), threshold) on the completion mask and logs the share of tokens whose
    ratio passed the threshold: maxpost's token_truncate with clip_max = threshold, and its corrected fraction."""
    old, sampler, mask = _tensors(6, sigma=0.8)
    sampler = np.nan_to_num(sampler, nan=old[0, 2])                    # Tunix has no NaN rule: score every token
    sampler[1, 0] = old[1, 0] - 30.0                                   # past Tunix's +-20 clip of the log-ratio
    log_ratio = np.clip(old - sampler, -20.0, 20.0)
    tunix_w = np.minimum(np.exp(log_ratio), 2.0) * mask
    tunix_frac = ((np.exp(log_ratio) > 2.0) & (mask > 0)).sum() / max(mask.sum(), 1.0)
    w, m = importance_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), "token_truncate", clip_max=2.0)
    valid = mask > 0
    np.testing.assert_allclose(np.asarray(w)[valid], tunix_w[valid], rtol=1e-6)
    np.testing.assert_allclose(float(m["sampling/importance_sampling_corrected_fraction"]), tunix_frac, rtol=1e-6)


# ---- sampling-mask replay under top-k / top-p (issue 50, item 6)

from maxpost.sampler_correction import replay_logps, sampling_mask_size
from maxpost.sampling import sample_token_logp


def _np_kept_set(z, temperature, top_k, top_p):
    "NumPy, from the definitions (Hugging Face's order): scale, keep the top_k, then the smallest prefix of the sorted renormalised survivors whose mass ahead of each kept token is below top_p; ties with the last survivor kept."
    z = np.asarray(z, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    srt = z[order]
    keep = np.ones(len(z), bool) if top_k <= 0 else np.arange(len(z)) < top_k
    p = np.exp(srt - srt[0]) * keep
    p /= p.sum()
    ahead = np.cumsum(p) - p
    keep &= (ahead < top_p) | (np.arange(len(z)) == 0)
    return z >= srt[keep].min(), z


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 0.8), (0.7, 5, 0.8), (1.3, 0, 0.8), (1.0, 5, 1.0)])
def test_replay_at_top_k_top_p_matches_numpy_and_the_sampler(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    B, T, V = 6, 12, 40
    logits = rng.normal(0, 2.0, (B, T, V)).astype(np.float32)
    toks, mu, n = [], [], []
    for t in range(T):
        tok, lp = sample_token_logp(jax.random.key(t), jnp.asarray(logits[:, t]), temperature, top_k, top_p)
        toks.append(np.asarray(tok)); mu.append(np.asarray(lp))
        n.append(np.asarray(sampling_mask_size(jnp.asarray(logits[:, t]), temperature, top_k, top_p)))
    toks, mu, n = np.stack(toks, 1), np.stack(mu, 1), np.stack(n, 1)
    ref_lp, ref_n, ref_mass = np.zeros((B, T)), np.zeros((B, T), int), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            kept, z = _np_kept_set(logits[b, t], temperature, top_k, top_p)
            ref_n[b, t] = kept.sum()
            ref_lp[b, t] = z[toks[b, t]] - np.log(np.exp(z[kept]).sum())
            ref_mass[b, t] = np.exp(z[kept]).sum() / np.exp(z).sum()
    np.testing.assert_array_equal(n, ref_n)
    lp, log_mass = replay_logps(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(n), temperature)
    np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(log_mass)), ref_mass, atol=1e-6)
    np.testing.assert_allclose(np.exp(np.asarray(lp) - mu), 1.0, atol=1e-5)       # the ratio to the sampler: 1
    if top_k:
        np.testing.assert_allclose(np.asarray(replay_logps(jnp.asarray(logits), jnp.asarray(toks), jnp.asarray(n),
                                                           temperature, max_kept=top_k)[0]), np.asarray(lp), atol=1e-6)
    # the weights of chapter 12c's correction are then 1 in every mode, where against the full softmax they are S
    full = np.asarray(jax.nn.log_softmax(jnp.asarray(logits) / temperature))
    full = np.take_along_axis(full, toks[..., None], -1)[..., 0]
    assert np.abs(full - mu).mean() > 0.05
    mask = np.ones((B, T), np.float32)
    for mode in IMPORTANCE_SAMPLING_MODES[1:]:
        w = np.asarray(importance_weights(lp, jnp.asarray(mu), jnp.asarray(mask), mode, clip_max=3.0)[0])
        np.testing.assert_allclose(w, 1.0, atol=1e-4 if mode.startswith("sequence") else 1e-5)


def test_replay_without_a_filter_is_the_full_softmax_and_keeps_the_token():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2.0, (3, 4, 20)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, 20, (3, 4)))
    assert (np.asarray(sampling_mask_size(logits[:, 0], 0.0, 5, 0.8)) == 0).all()        # greedy
    assert (np.asarray(sampling_mask_size(logits[:, 0], 1.0, 0, 1.0)) == 0).all()        # no filter
    lp, log_mass = replay_logps(logits, toks, jnp.zeros((3, 4), jnp.int32), 1.0)
    np.testing.assert_allclose(np.asarray(lp), np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                                                                  np.asarray(toks)[..., None], -1)[..., 0], atol=1e-6)
    assert np.abs(np.asarray(log_mass)).max() < 1e-6
    # a count of 1 whose largest logit is not the token: the token is kept beside it (finite, renormalised over 2)
    z = np.asarray(logits[0, 0], np.float64)
    low = int(np.argsort(z)[3])
    lp1, _ = replay_logps(logits[:1, :1], jnp.array([[low]]), jnp.array([[1]]), 1.0)
    np.testing.assert_allclose(float(lp1[0, 0]), z[low] - np.log(np.exp(z.max()) + np.exp(z[low])), atol=1e-5)


def test_replay_gradient_is_the_kept_softmax_gradient():
    "d log pi_K(y) / d z = onehot(y) - softmax over K (0 outside K), against NumPy."
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2.0, (2, 3, 15)).astype(np.float32)
    toks = rng.integers(0, 15, (2, 3))
    n = np.full((2, 3), 4)
    g = np.asarray(jax.grad(lambda z: replay_logps(z, jnp.asarray(toks), jnp.asarray(n), 1.0)[0].sum())(jnp.asarray(logits)))
    for b in range(2):
        for t in range(3):
            z = logits[b, t].astype(np.float64)
            kept = z >= np.sort(z)[::-1][3]
            kept[toks[b, t]] = True
            p = np.where(kept, np.exp(z - z[kept].max()), 0.0)
            p /= p.sum()
            np.testing.assert_allclose(g[b, t], np.eye(15)[toks[b, t]] - p, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_replay_bisection_and_top_k_paths_find_the_sorted_set(seed):
    "The bisection on the float bits and lax.top_k give the set of a full sort, with ties, zeros of both signs, -inf."
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, (3, 8, 64)).astype(np.float32)
    z[0] = np.round(z[0])                                            # many ties
    z[1, :, :5] = 0.0; z[1, :, 5:8] = -0.0; z[2, :, :4] = -np.inf
    n = rng.integers(1, 20, (3, 8))
    toks = np.argsort(-z, -1)[..., 0]                                # the most likely token: always inside the set
    srt = -np.sort(-z.astype(np.float64), -1)
    kept = z >= np.take_along_axis(srt, n[..., None] - 1, -1)
    zz = np.where(kept, z.astype(np.float64), -np.inf)
    ref = np.take_along_axis(zz, toks[..., None], -1)[..., 0] - np.log(np.exp(zz - zz.max(-1, keepdims=True)).sum(-1)) - zz.max(-1)
    for max_kept in (None, 20):
        lp = np.asarray(replay_logps(jnp.asarray(z), jnp.asarray(toks), jnp.asarray(n), 1.0, max_kept=max_kept)[0])
        np.testing.assert_allclose(lp, ref, atol=1e-5)
