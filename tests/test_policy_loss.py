"""maxpost.policy_loss: parity with Tunix's grpo_loss_fn / aggregate_loss / compute_kl_divergence (Tunix itself is
run), an independent NumPy version with finite-difference gradients, and the invariants the book states."""
import itertools
import zlib
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxpost.policy_loss import (CISPO_EPSILONS, KL_ESTIMATORS, LOSS_AGG_MODES, LOSS_ALGOS, POLICY_LOSS_ALGOS,
                                 aggregate_loss, estimate_kl, importance_ratio, policy_loss)

import tunix.rl.algo_core as algo_core  # the dev extra installs Tunix: a missing Tunix fails, never skips
from tunix.rl import common as tunix_common  # noqa: E402
from flax import nnx  # noqa: E402

TUNIX_AGG = {"token-mean": "token-mean", "sequence-mean-token-mean": "sequence-mean-token-mean",
             "sequence-mean-token-scale": "sequence-mean-token-scale",
             "sequence-mean-token-sum": "seq-mean-token-sum", "token-sum-norm": "sequence-mean-token-sum-norm"}
TUNIX_KL = {"k1": "kl", "k2": "mse_kl", "k3": "low_var_kl"}
EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_DIFF = {}  # largest |maxpost - Tunix| seen per quantity, printed with `pytest -s`


def _data(seed, B=6, T=8, on_policy=False, empty_row=True):
    rng = np.random.default_rng(seed)
    lp = rng.normal(-1.2, 0.6, (B, T)).astype(np.float32)
    lengths = rng.integers(1, T + 1, B)
    if empty_row:
        lengths[B // 2] = 0
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    old = None if on_policy else (lp + rng.normal(0, 0.25, (B, T)) + rng.uniform(-0.3, 0.3, (B, 1))).astype(np.float32)
    ref = (lp + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    return lp, old, ref, adv, mask


def _j(x):
    return None if x is None else jnp.asarray(x)


# ----------------------------------------------------------------------------------------------------------------
# Tunix harness: grpo_loss_fn asks a model for log-probs through common.compute_per_token_logps; we patch that call
# so Tunix's loss runs on our per_token_logps (and differentiates with respect to them).

class _NoModel(nnx.Module):
    def __init__(self):
        self.unused = nnx.Param(jnp.zeros(()))


def _tunix(lp, old, ref, adv, mask, *, loss_algo, agg, kl_mode, beta):
    cfg = SimpleNamespace(beta=beta, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, loss_algo=loss_algo,
                          loss_agg_mode=TUNIX_AGG[agg], temperature=1.0, kl_loss_mode=kl_mode or "kl",
                          kl_clamp_value=None)
    B, T = mask.shape

    def f(x):
        example = SimpleNamespace(prompt_ids=jnp.ones((B, 2), jnp.int32), completion_ids=jnp.ones((B, T), jnp.int32),
                                  completion_mask=jnp.asarray(mask), advantages=jnp.asarray(adv),
                                  old_per_token_logps=_j(old), ref_per_token_logps=_j(ref))
        fake = lambda *a, **k: (x, jnp.zeros(x.shape + (3,), jnp.float32))
        with mock.patch.object(tunix_common, "compute_per_token_logps", fake):
            return algo_core.grpo_loss_fn(_NoModel(), example, cfg, pad_id=0, eos_id=2)

    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    return loss, aux, grad


def _ours(lp, old, ref, adv, mask, **kw):
    f = lambda x: policy_loss(x, _j(old), _j(ref), jnp.asarray(adv), jnp.asarray(mask), **kw)
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    return loss, metrics, grad


def _close(name, a, b, atol=1e-5):
    d = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), d)
    assert d <= atol, f"{name}: max |diff| {d:.3g} > {atol}"


@pytest.mark.parametrize("on_policy", [False, True], ids=["off-policy", "on-policy"])
@pytest.mark.parametrize("kl", [None, "k1", "k2", "k3"])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token"])
def test_matches_tunix_grpo_loss_fn(loss_algo, agg, kl, on_policy):
    "Loss, gradient and shared metrics agree with Tunix's grpo_loss_fn on the same inputs."
    lp, old, ref, adv, mask = _data(zlib.crc32(f"{loss_algo}{agg}{kl}{on_policy}".encode()) % 1000, on_policy=on_policy)
    beta = 0.0 if kl is None else 0.07
    ref = None if kl is None else ref
    t_loss, t_aux, t_grad = _tunix(lp, old, ref, adv, mask, loss_algo=loss_algo, agg=agg,
                                   kl_mode=TUNIX_KL.get(kl), beta=beta)
    loss, m, grad = _ours(lp, old, ref, adv, mask, loss_algo=loss_algo, loss_agg_mode=agg, beta=beta,
                          kl_estimator=kl or "k3", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    _close("loss", loss, t_loss)
    _close("grad", grad, t_grad)
    _close("clip_frac", m["clip_ratio/region_mean"], t_aux["pg_clipfrac"])
    _close("ratio_mean", m["ratio/mean"], t_aux["is_ratio/mean"])
    _close("ratio_min/max", [m["ratio/min"], m["ratio/max"]], [t_aux["is_ratio/min"], t_aux["is_ratio/max"]])
    if kl is not None:
        _close("kl", m["kl"], t_aux["kl"])
        _close("kl_loss", m["loss/kl"], t_aux["kl_loss"])
    assert np.abs(np.asarray(t_grad)).max() > 1e-3
    if not on_policy:  # the data must exercise the clip, or the test would prove little
        assert loss_algo == "gspo-token" or float(m["clip_ratio/region_mean"]) > 0


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_aggregate_loss_matches_tunix(agg):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 11)).astype(np.float32)
    _, _, _, _, mask = _data(2, B=7, T=11)
    _close("aggregate", aggregate_loss(jnp.asarray(x), jnp.asarray(mask), agg),
           tunix_common.aggregate_loss(jnp.asarray(x), jnp.asarray(mask), TUNIX_AGG[agg]))
    if agg == "sequence-mean-token-scale":  # Dr. GRPO's constant normaliser
        _close("aggregate", aggregate_loss(jnp.asarray(x), jnp.asarray(mask), agg, max_completion_length=64),
               tunix_common.aggregate_loss(jnp.asarray(x), jnp.asarray(mask), TUNIX_AGG[agg], norm=64))


@pytest.mark.parametrize("kl", KL_ESTIMATORS)
def test_estimate_kl_matches_tunix(kl):
    lp, _, ref, _, _ = _data(3)
    _close("estimate_kl", estimate_kl(jnp.asarray(lp), jnp.asarray(ref), kl),
           tunix_common.compute_kl_divergence(jnp.asarray(lp), jnp.asarray(ref), TUNIX_KL[kl]))


def test_documented_difference_gspo_token_log_ratio_cap():
    "Tunix caps gspo-token's constructed log-ratio at 10; maxpost does not (so gspo == gspo-token). Below 10 they agree."
    lp, old, _, adv, mask = _data(4)
    old = old.copy()
    old[0] = lp[0] - 12.0  # sequence 0: mean log-ratio 12 > 10
    adv[0] = -1.0  # negative advantage: the unclipped (large) term is active
    t_loss, _, t_grad = _tunix(lp, old, None, adv, mask, loss_algo="gspo-token", agg="token-mean", kl_mode=None, beta=0.0)
    loss, _, grad = _ours(lp, old, None, adv, mask, loss_algo="gspo-token")
    assert float(loss) > float(t_loss) + 1.0  # e^12 vs e^10 on sequence 0's tokens
    assert np.all(np.asarray(t_grad)[0] == 0) and np.all(np.asarray(grad)[0][mask[0] > 0] != 0)
    np.testing.assert_allclose(np.asarray(grad)[1:], np.asarray(t_grad)[1:], atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Independent NumPy version, float64, gradients by central finite differences.

def _np_loss(lp, old, ref, adv, mask, *, algo, agg, kl, beta, el, eh, L=None, lp0=None):
    """The loss as a NumPy function of lp. Stop-gradient quantities (old when on-policy; gspo-token's sequence ratio)
    are evaluated at lp0, so d/dlp at lp0 is exactly the gradient the JAX code must produce."""
    lp = np.asarray(lp, np.float64)
    lp0 = lp if lp0 is None else np.asarray(lp0, np.float64)
    old = lp0 if old is None else np.asarray(old, np.float64)
    B, T = lp.shape
    L = T if L is None else L
    per_seq_token_losses, kls = [], []
    for i in range(B):
        idx = np.nonzero(mask[i])[0]
        if len(idx) == 0:
            continue
        if algo == "grpo":
            r = np.exp(np.clip(lp[i, idx] - old[i, idx], -20, 20))
        elif algo == "gspo":
            r = np.full(len(idx), np.exp(np.mean(np.clip(lp[i, idx] - old[i, idx], -20, 20))))
        else:  # gspo-token: value s_i (frozen at lp0) times pi/sg[pi]
            s = np.exp(np.mean(np.clip(lp0[i, idx] - old[i, idx], -20, 20)))
            r = s * np.exp(lp[i, idx] - lp0[i, idx])
        tok = np.maximum(-adv[i] * r, -np.clip(r, 1 - el, 1 + eh) * adv[i])
        if algo == "gspo":
            tok = tok[:1]  # one term per sequence
        per_seq_token_losses.append(tok)
        if kl is not None:
            d = np.asarray(ref, np.float64)[i, idx] - lp[i, idx]
            kls.append({"k1": -d, "k2": 0.5 * d**2, "k3": np.exp(d) - d - 1}[kl])

    def agg_fn(seqs):
        S = len(seqs)
        if agg == "token-mean":
            return sum(s.sum() for s in seqs) / sum(len(s) for s in seqs)
        if agg == "sequence-mean-token-mean":
            return sum(s.mean() for s in seqs) / S
        if agg == "sequence-mean-token-scale":
            return sum(s.sum() / L for s in seqs) / S
        return sum(s.sum() for s in seqs) / S

    return agg_fn(per_seq_token_losses) + (beta * agg_fn(kls) if kl is not None else 0.0)


def _fd_grad(fn, x, h=1e-6):
    g = np.zeros_like(x, np.float64)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.astype(np.float64).copy(), x.astype(np.float64).copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (fn(xp) - fn(xm)) / (2 * h)
    return g


_NUMPY_CASES = [(a, g, k, o) for a, g, k, o in itertools.product(LOSS_ALGOS, LOSS_AGG_MODES, [None, "k1", "k2", "k3"],
                                                                    [False, True])
                if a != "gspo" or g == "sequence-mean-token-mean"]


@pytest.mark.parametrize("loss_algo,agg,kl,on_policy", _NUMPY_CASES)
def test_matches_numpy_with_finite_difference_gradient(loss_algo, agg, kl, on_policy):
    lp, old, ref, adv, mask = _data(17, B=5, T=6, on_policy=on_policy)
    el, eh = (3e-4, 4e-4) if loss_algo != "grpo" and not on_policy else (EPS_LOW, EPS_HIGH)
    if loss_algo != "grpo" and not on_policy:  # a nearby old policy, so that GSPO's tiny range clips some sequences
        old = (lp + np.random.default_rng(0).normal(0, 2e-3, lp.shape)).astype(np.float32)
    beta = 0.0 if kl is None else 0.05
    L = 10 if agg == "sequence-mean-token-scale" else None
    kw = dict(algo=loss_algo, agg=agg, kl=kl, beta=beta, el=el, eh=eh, L=L)
    loss, m, grad = _ours(lp, old, None if kl is None else ref, adv, mask, loss_algo=loss_algo, loss_agg_mode=agg,
                          beta=beta, kl_estimator=kl or "k3", epsilon_low=el, epsilon_high=eh, max_completion_length=L)
    np.testing.assert_allclose(float(loss), _np_loss(lp, old, ref, adv, mask, **kw), atol=1e-5, rtol=1e-5)
    fd = _fd_grad(lambda x: _np_loss(x, old, ref, adv, mask, lp0=lp, **kw), lp)
    np.testing.assert_allclose(np.asarray(grad), fd, atol=2e-5)


def test_numpy_clip_fractions():
    lp, old, _, adv, mask = _data(8)
    _, m, _ = _ours(lp, old, None, adv, mask)
    r = np.exp(lp.astype(np.float64) - old)
    valid = mask > 0
    low = valid & (adv[:, None] < 0) & (r < 1 - EPS_LOW)
    high = valid & (adv[:, None] > 0) & (r > 1 + EPS_HIGH)
    np.testing.assert_allclose(float(m["clip_ratio/low_mean"]), low.sum() / valid.sum(), atol=1e-6)
    np.testing.assert_allclose(float(m["clip_ratio/high_mean"]), high.sum() / valid.sum(), atol=1e-6)
    np.testing.assert_allclose(float(m["clip_ratio/region_mean"]), (low | high).sum() / valid.sum(), atol=1e-6)
    assert low.any() and high.any()
    np.testing.assert_allclose([float(m["ratio/min"]), float(m["ratio/max"])], [r[valid].min(), r[valid].max()], rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Invariants

@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_on_policy_gspo_and_grpo_gradients_coincide(beta):
    "On-policy, with one advantage per sequence, under sequence-mean-token-mean: same loss and same gradient."
    lp, _, ref, adv, mask = _data(21, on_policy=True)
    kw = dict(loss_agg_mode="sequence-mean-token-mean", beta=beta)
    a = _ours(lp, None, ref, adv, mask, loss_algo="grpo", **kw)
    b = _ours(lp, None, ref, adv, mask, loss_algo="gspo", **kw)
    np.testing.assert_allclose(float(a[0]), float(b[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(a[2]), np.asarray(b[2]), atol=1e-7)
    assert np.abs(np.asarray(a[2])).max() > 1e-3
    # off-policy they differ (token ratios vs the sequence ratio)
    lp2, old, _, _, _ = _data(21)
    c = _ours(lp2, old, ref, adv, mask, loss_algo="grpo", **kw)
    d = _ours(lp2, old, ref, adv, mask, loss_algo="gspo", **kw)
    assert np.abs(np.asarray(c[2]) - np.asarray(d[2])).max() > 1e-4


@pytest.mark.parametrize("eps", [(EPS_LOW, EPS_HIGH), (3e-4, 4e-4)])
@pytest.mark.parametrize("on_policy", [False, True])
def test_gspo_and_gspo_token_agree_under_sequence_mean(eps, on_policy):
    lp, old, ref, adv, mask = _data(22, on_policy=on_policy)
    kw = dict(loss_agg_mode="sequence-mean-token-mean", epsilon_low=eps[0], epsilon_high=eps[1], beta=0.02)
    a = _ours(lp, old, ref, adv, mask, loss_algo="gspo", **kw)
    b = _ours(lp, old, ref, adv, mask, loss_algo="gspo-token", **kw)
    np.testing.assert_allclose(float(a[0]), float(b[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(a[2]), np.asarray(b[2]), atol=1e-7)
    for k in a[1]:
        np.testing.assert_allclose(float(a[1][k]), float(b[1][k]), atol=1e-6)
    if eps[0] < 1e-3 and not on_policy:
        assert 0 < float(a[1]["clip_ratio/region_mean"]) < 1


_ALL = [(a, g) for a in POLICY_LOSS_ALGOS for g in LOSS_AGG_MODES if a != "gspo" or g == "sequence-mean-token-mean"]


@pytest.mark.parametrize("loss_algo,agg", _ALL)
def test_masked_positions_change_nothing(loss_algo, agg):
    lp, old, ref, adv, mask = _data(23)
    kw = dict(loss_algo=loss_algo, loss_agg_mode=agg, beta=0.1, kl_estimator="k3")
    base = _ours(lp, old, ref, adv, mask, **kw)
    junk = lambda x: np.where(mask > 0, x, np.float32(np.nan)).astype(np.float32)
    lp2, old2, ref2 = junk(lp), junk(old), junk(ref)
    rows, cols = np.nonzero(mask == 0)
    lp2[rows[::2], cols[::2]] = -np.inf
    ref2[:, -1] = np.where(mask[:, -1] > 0, ref2[:, -1], 1e4)
    out = _ours(lp2, old2, ref2, adv, mask, **kw)
    np.testing.assert_allclose(float(out[0]), float(base[0]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[2]), np.asarray(base[2]), atol=1e-8)
    assert np.all(np.asarray(out[2])[mask == 0] == 0)
    for k in base[1]:
        np.testing.assert_allclose(float(out[1][k]), float(base[1][k]), rtol=1e-6)


@pytest.mark.parametrize("loss_algo,agg", _ALL)
def test_jit_matches_eager(loss_algo, agg):
    lp, old, ref, adv, mask = _data(24)
    f = jax.jit(jax.value_and_grad(policy_loss, has_aux=True),
                static_argnames=("loss_algo", "loss_agg_mode", "kl_estimator", "max_completion_length"))
    args = (jnp.asarray(lp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask))
    kw = dict(loss_algo=loss_algo, loss_agg_mode=agg, kl_estimator="k2")
    (lj, mj), gj = f(*args, **kw, beta=jnp.float32(0.05), epsilon_low=jnp.float32(0.1))  # traced beta / epsilon
    (le, me), ge = jax.value_and_grad(policy_loss, has_aux=True)(*args, **kw, beta=0.05, epsilon_low=0.1)
    np.testing.assert_allclose(float(lj), float(le), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gj), np.asarray(ge), rtol=1e-5, atol=1e-8)
    for k in me:
        np.testing.assert_allclose(float(mj[k]), float(me[k]), rtol=1e-6, atol=1e-7)


def test_on_policy_ratio_is_exactly_one():
    lp, _, _, adv, mask = _data(25, on_policy=True)
    for algo in POLICY_LOSS_ALGOS:
        r = np.asarray(importance_ratio(jnp.asarray(lp), None, jnp.asarray(mask), algo))
        assert np.all(r[mask > 0] == 1.0)
    _, m, _ = _ours(lp, None, None, adv, mask)
    assert float(m["clip_ratio/region_mean"]) == 0 and float(m["ratio/min"]) == 1 and float(m["ratio/max"]) == 1


def test_aliases_and_errors():
    lp, old, ref, adv, mask = _data(26)
    args = (jnp.asarray(lp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask))
    for alias, canon in (("seq-mean-token-sum", "sequence-mean-token-sum"), ("sequence-mean-token-sum-norm", "token-sum-norm")):
        assert float(policy_loss(*args, loss_agg_mode=alias)[0]) == float(policy_loss(*args, loss_agg_mode=canon)[0])
    with pytest.raises(ValueError, match="grpo, gspo, gspo-token"):
        policy_loss(*args, loss_algo="ppo")
    with pytest.raises(ValueError, match="token-mean, sequence-mean-token-mean"):
        policy_loss(*args, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        policy_loss(*args, kl_estimator="low_var_kl")
    for mode in set(LOSS_AGG_MODES) - {"sequence-mean-token-mean"} | {"seq-mean-token-sum"}:
        with pytest.raises(ValueError, match="length"):
            policy_loss(*args, loss_algo="gspo", loss_agg_mode=mode)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        policy_loss(*args[:2], None, *args[3:], beta=0.04)
    policy_loss(*args[:2], None, *args[3:], beta=0.0)  # no reference needed without a KL term


# ----------------------------------------------------------------------------------------------------------------
# CISPO (MiniMax-M1, 2025) against TRL's formula. TRL is not called: its `cispo` branch of
# GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py, huggingface/trl at commit f2cd577, July 2026; not checked
# against the 1.16 release that settings.ini's dev extra pins) is ported below, in NumPy for the value and in torch,
# line for line, for the gradient (its clamped ratio is `.detach()`ed, which a finite difference cannot reproduce).
# TRL's `epsilon_high` is the cap on the weight itself (TRL recommends 5.0); maxpost's is 1 + epsilon_high.

def _trl_cispo_numpy(lp, old, ref, adv, mask, is_ratio, eps_high_trl, beta):
    coef_1 = np.exp(lp.astype(np.float64) - old)                         # importance_sampling_level="token"
    clamped_ratios = np.minimum(coef_1, eps_high_trl)                    # torch.clamp(coef_1, max=epsilon_high)
    per_token_loss = -clamped_ratios * adv[:, None] * lp
    per_token_loss = per_token_loss * is_ratio                           # vllm importance sampling correction
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (np.exp(ref - lp) - (ref - lp) - 1)
    num_items_in_batch = max(mask.sum(), 1.0)                            # loss_type in ["cispo", "dapo", "vespo"]
    return (per_token_loss * mask).sum() / num_items_in_batch


def _trl_cispo_torch_grad(lp, old, ref, adv, mask, is_ratio, eps_high_trl, beta):
    import torch
    t = lambda x: torch.tensor(np.asarray(x, np.float64))
    per_token_logps = t(lp).requires_grad_(True)
    coef_1 = torch.exp(per_token_logps - t(old))
    clamped_ratios = torch.clamp(coef_1, max=eps_high_trl).detach()
    per_token_loss = -clamped_ratios * t(adv).unsqueeze(1) * per_token_logps
    per_token_loss = per_token_loss * t(is_ratio)
    if beta != 0.0:
        ref_t = t(ref)
        per_token_loss = per_token_loss + beta * (torch.exp(ref_t - per_token_logps) - (ref_t - per_token_logps) - 1)
    loss = (per_token_loss * t(mask)).sum() / t(mask).sum().clamp(min=1.0)
    loss.backward()
    return per_token_logps.grad.numpy()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps_high", [CISPO_EPSILONS[1], 0.28])
@pytest.mark.parametrize("beta,weighted", [(0.0, False), (0.04, False), (0.0, True)])
def test_cispo_matches_trl(seed, eps_high, beta, weighted):
    lp, _, ref, adv, mask = _data(100 + seed, B=7, T=9)
    rng = np.random.default_rng(seed)
    old = (lp + rng.normal(0, 1.5, lp.shape)).astype(np.float32)       # far enough that many weights are capped
    is_ratio = rng.uniform(0.2, 2.0, lp.shape).astype(np.float32) if weighted else np.ones_like(lp)
    args = (lp, old, ref, adv, mask.astype(np.float64), is_ratio, 1.0 + eps_high, beta)
    f = lambda x: policy_loss(x, jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask),
                              loss_algo="cispo", epsilon_low=CISPO_EPSILONS[0], epsilon_high=eps_high, beta=beta,
                              loss_agg_mode="token-mean", importance_weights=jnp.asarray(is_ratio) if weighted else None)
    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), _trl_cispo_numpy(*args), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), _trl_cispo_torch_grad(*args), atol=1e-6)
    capped = (np.exp(lp.astype(np.float64) - old) > 1.0 + eps_high) & (mask > 0)
    assert capped.any() and (~capped & (mask > 0)).any()
    np.testing.assert_allclose(float(m["clip_ratio/high_mean"]), capped.sum() / mask.sum(), atol=1e-6)
    # no token's gradient is dropped by the clip: every real token with a nonzero advantage moves
    live = (mask > 0) & (np.abs(adv)[:, None] > 1e-6)
    assert (np.asarray(grad)[live] != 0).all() and (np.asarray(grad)[mask == 0] == 0).all()


def test_cispo_with_a_lower_bound_and_other_aggregations():
    "The optional lower bound raises small weights to 1 - epsilon_low; each aggregation divides as for GRPO."
    lp, _, _, adv, mask = _data(130)
    old = (lp + np.random.default_rng(1).normal(0, 0.8, lp.shape)).astype(np.float32)
    w = np.clip(np.exp(lp.astype(np.float64) - old), 0.8, 1.28)
    per_tok = np.where(mask > 0, -w * adv[:, None] * lp, 0.0)
    for agg in LOSS_AGG_MODES:
        loss, m, grad = _ours(lp, old, None, adv, mask, loss_algo="cispo", epsilon_low=0.2, epsilon_high=0.28,
                              loss_agg_mode=agg)
        np.testing.assert_allclose(float(loss), float(aggregate_loss(jnp.asarray(per_tok), jnp.asarray(mask), agg)),
                                   rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grad),
                                   np.asarray(jax.grad(lambda x: aggregate_loss(x, jnp.asarray(mask), agg))(
                                       jnp.asarray(per_tok))) * np.where(mask > 0, -w * adv[:, None], 0.0), atol=1e-6)
    valid = mask > 0
    low = valid & (np.exp(lp.astype(np.float64) - old) < 0.8)
    assert low.any()
    np.testing.assert_allclose(float(m["clip_ratio/low_mean"]), low.sum() / valid.sum(), atol=1e-6)


def test_cispo_on_policy_gradient_is_grpo_gradient():
    lp, _, ref, adv, mask = _data(131, on_policy=True)
    for agg in LOSS_AGG_MODES:
        g = [_ours(lp, None, ref, adv, mask, loss_algo=a, loss_agg_mode=agg, beta=0.02)[2] for a in ("cispo", "grpo")]
        np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g[1]), atol=1e-7)


@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token", "cispo"])
def test_per_token_advantages(loss_algo):
    "Advantages [B,T] (GAE, chapter 12e), as TRL's GRPOTrainer takes them (it unsqueezes only a [B] tensor)."
    lp, old, _, _, mask = _data(140)
    adv_bt = np.random.default_rng(2).normal(size=lp.shape).astype(np.float32)
    eps = dict(zip(("epsilon_low", "epsilon_high"), CISPO_EPSILONS if loss_algo == "cispo" else (0.2, 0.28)))
    (loss, _), grad = jax.value_and_grad(lambda x: policy_loss(x, jnp.asarray(old), None, jnp.asarray(adv_bt),
                                                               jnp.asarray(mask), loss_algo=loss_algo, **eps), has_aux=True)(jnp.asarray(lp))
    lp64, n = lp.astype(np.float64), mask.sum()
    if loss_algo == "cispo":
        w = np.minimum(np.exp(lp64 - old), 1.0 + CISPO_EPSILONS[1])
        want, want_g = (-w * adv_bt * lp64 * mask).sum() / n, -w * adv_bt * mask / n
    else:
        def f(x):
            lr = np.clip(x - old, -20, 20)
            if loss_algo == "gspo-token":   # value: the sequence's geometric-mean ratio at every token
                lr = np.broadcast_to(((lr * mask).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None], x.shape)
            r = np.exp(lr)
            return (np.maximum(-r * adv_bt, -np.clip(r, 0.8, 1.28) * adv_bt) * mask).sum() / n
        want = f(lp64)
        want_g = _fd_grad(f, lp64) if loss_algo == "grpo" else None
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    if want_g is not None:
        np.testing.assert_allclose(np.asarray(grad), want_g, atol=2e-5)
    with pytest.raises(ValueError, match="shape \\[B\\]"):
        policy_loss(jnp.asarray(lp), jnp.asarray(old), None, jnp.asarray(adv_bt), jnp.asarray(mask), loss_algo="gspo",
                    loss_agg_mode="sequence-mean-token-mean")


def test_report_max_diffs():
    "Runs last: prints the largest differences against Tunix seen above (visible with pytest -s)."
    print("\nmax |maxpost - Tunix|:", {k: f"{v:.2e}" for k, v in MAX_DIFF.items()})
