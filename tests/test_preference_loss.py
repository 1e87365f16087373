"""maxpost.preference_loss against Tunix's own dpo_loss_fn (run here, on Tunix's test inputs), a naive NumPy
version of each loss type and its analytic gradient."""
from unittest import mock

import jax, jax.numpy as jnp, numpy as np, pytest

from maxpost.preference_loss import preference_loss, sequence_logps, LOSS_TYPES


def _tunix_inputs():
    "Tunix's tests/sft/dpo/dpo_trainer_test.py::test_dpo_loss_fn: numpy seed 0, per-token log-probs N(0, 5) (8, 4)."
    np.random.seed(0)
    per_token = np.random.normal(0, 5, size=(8, 4))
    ref = np.random.normal(0, 5, size=(8, 4)).sum(axis=-1)
    return per_token, ref


def _tunix_loss(per_token, ref, mask, **kw):
    "Tunix's dpo_loss_fn itself, its model's per-token log-probs replaced by `per_token` as Tunix's test does."
    from tunix.rl import common
    from tunix.sft.dpo import dpo_trainer as dpo_lib
    B, T = per_token.shape
    example = dpo_lib.TrainExample(input_ids=jnp.arange(B * T).reshape(B, T), positions=jnp.ones((B, T)),
                                   attention_mask=jnp.ones((B, T, T)), logits_to_keep=T,
                                   ref_chosen_logps=None if ref is None else jnp.asarray(ref[:B // 2]),
                                   ref_rejected_logps=None if ref is None else jnp.asarray(ref[B // 2:]),
                                   completion_mask=jnp.asarray(mask, jnp.float32))
    with mock.patch.object(common, "get_per_token_logps", return_value=jnp.asarray(per_token)):
        out = dpo_lib.dpo_loss_fn(None, example, **kw)
    loss, aux = out if isinstance(out, tuple) else (out.primary_loss.compute(), out.aux)
    return float(loss), {k: float(v) for k, v in aux.items()}


def _ours(per_token, ref, mask, **kw):
    s, n = sequence_logps(jnp.asarray(per_token), jnp.asarray(mask))
    h = len(s) // 2
    return preference_loss(s[:h], s[h:], n[:h], n[h:], None if ref is None else ref[:h],
                           None if ref is None else ref[h:], **kw)


@pytest.mark.parametrize("label_smoothing,expected", [(0.0, 0.753059), (0.3, 0.925447)])
def test_dpo_reproduces_tunix_on_its_own_test_inputs(label_smoothing, expected):
    per_token, ref = _tunix_inputs()
    mask = np.ones((8, 4))
    loss, m = _ours(per_token, ref, mask, beta=0.1, label_smoothing=label_smoothing)
    np.testing.assert_allclose(float(loss), expected, atol=1e-5)          # the constant Tunix's test asserts
    t_loss, t_aux = _tunix_loss(per_token, ref, mask, beta=0.1, label_smoothing=label_smoothing)
    np.testing.assert_allclose(float(loss), t_loss, rtol=1e-6)
    for ours, theirs in [("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                         ("rewards/margins", "rewards/margin"), ("rewards/accuracies", "rewards/accuracy"),
                         ("logps/chosen", "log_probs/chosen"), ("logps/rejected", "log_probs/rejected")]:
        np.testing.assert_allclose(float(m[ours]), t_aux[theirs], rtol=1e-5, atol=1e-6)


def test_dpo_with_padding_equals_tunix():
    "Replies of different lengths (a completion mask with zeros): the same loss as Tunix's masked sums."
    rng = np.random.default_rng(3)
    per_token, ref = -np.abs(rng.normal(1, 1, (8, 6))), rng.normal(-6, 2, 8)
    mask = (np.arange(6)[None] < rng.integers(1, 7, (8, 1))).astype(np.float32)
    np.testing.assert_allclose(float(_ours(per_token, ref, mask, beta=0.2)[0]),
                               _tunix_loss(per_token, ref, mask, beta=0.2)[0], rtol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_orpo_equals_tunix_on_one_token_replies(label_smoothing):
    """Tunix takes summed log-probs in ORPO's odds where the paper and TRL average them per token; on one-token
    replies the two are the same number, and there maxpost's ORPO loss and metrics equal Tunix's."""
    rng = np.random.default_rng(0)
    per_token = -np.abs(rng.normal(0.7, 0.5, (8, 1))) - 1e-3
    mask = np.ones((8, 1))
    loss, m = _ours(per_token, None, mask, loss_type="orpo", lambda_orpo=0.1, label_smoothing=label_smoothing)
    t_loss, t_aux = _tunix_loss(per_token, None, mask, algorithm="orpo", lambda_orpo=0.1, label_smoothing=label_smoothing)
    np.testing.assert_allclose(float(loss), t_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["nll_loss"]), t_aux["sft_loss"], rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/chosen"]), t_aux["rewards/chosen"], rtol=1e-5)


def _naive_grad_sigmoid(cw, cl, rw, rl, beta, ls):
    "d mean loss / d chosen_logps of DPO by its formula: per pair -beta * ((1-ls) sigma(-z) - ls sigma(z)) / B."
    z = beta * ((cw - rw) - (cl - rl))
    sig = lambda v: 1 / (1 + np.exp(-v))
    return -beta * ((1 - ls) * sig(-z) - ls * sig(z)) / len(cw)


@pytest.mark.parametrize("ls", [0.0, 0.25])
def test_dpo_gradient_matches_its_formula(ls):
    rng = np.random.default_rng(1)
    cw, cl, rw, rl = (rng.normal(-30, 8, 16) for _ in range(4))
    n = np.full(16, 10.0)
    g = jax.grad(lambda c: preference_loss(c, cl, n, n, rw, rl, beta=0.1, label_smoothing=ls)[0])(jnp.asarray(cw))
    np.testing.assert_allclose(np.asarray(g), _naive_grad_sigmoid(cw, cl, rw, rl, 0.1, ls), rtol=1e-4, atol=1e-8)
    g_l = jax.grad(lambda c: preference_loss(jnp.asarray(cw), c, n, n, rw, rl, beta=0.1, label_smoothing=ls)[0])(jnp.asarray(cl))
    np.testing.assert_allclose(np.asarray(g_l), -np.asarray(g), rtol=1e-5, atol=1e-8)   # h is antisymmetric


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_at_initialisation_nothing_is_preferred(loss_type):
    """policy = reference (or, reference-free, equal chosen and rejected log-probs): margin 0, accuracy 0 (no pair is
    ordered strictly), and the loss is the formula's value at 0: log 2, (1/(2 beta))^2, 1, log(1 + e^gamma), ORPO's NLL + lambda log 2."""
    beta, gamma, lam = 0.1, 0.5, 0.1
    lp, n = jnp.full(4, -12.0), jnp.full(4, 4.0)
    ref = None if loss_type in ("orpo", "simpo") else lp
    loss, m = preference_loss(lp, lp, n, n, ref, ref, loss_type=loss_type, beta=beta, simpo_gamma=gamma, lambda_orpo=lam)
    expected = {"sigmoid": np.log(2), "ipo": (1 / (2 * beta)) ** 2, "hinge": 1.0, "simpo": np.log1p(np.exp(gamma)),
                "orpo": 3.0 + lam * np.log(2)}[loss_type]
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert float(m["rewards/margins"]) == 0.0 and float(m["rewards/accuracies"]) == 0.0
