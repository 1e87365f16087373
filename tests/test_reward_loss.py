"""The reward model's Bradley-Terry loss (margin, centring) and KTO's loss (weights, the clamped and stopped KL
reference point from mismatched pairs) against three references on random inputs with padding: a NumPy port of the
paper's formula, a NumPy port of TRL 1.16's code, and TRL's own code run with torch (values and gradients).

TRL 1.16.0: `RewardTrainer.compute_loss` (trl/trainer/reward_trainer.py, the lines after "Split the rewards into
chosen and rejected") and `KTOTrainer._compute_loss` / `get_batch_loss_metrics` (trl/trainer/kto_trainer.py, the
lines from "if self.calculate_KL:" to "loss = losses.nanmean()"). Both are called here as unbound methods on a stand-in
`self` (the metrics store and an identity accelerator) with a stand-in model that returns the given scores or
per-token log-probs, so the arithmetic under test is TRL's own."""
from collections import defaultdict
from types import SimpleNamespace

import jax, jax.numpy as jnp, numpy as np, pytest

from maxpost.preference_loss import kto_loss, mismatched, reward_loss, sequence_logps

torch = pytest.importorskip("torch")
trl_reward = pytest.importorskip("trl.trainer.reward_trainer")
trl_kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")


class _Accelerator:
    "What TRL's losses ask of accelerate on one process: gathers are the identity."
    device = torch.device("cpu")
    def gather(self, x): return x
    def gather_for_metrics(self, x): return x


def _trainer(**args):
    return SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1, **args)


# ---------------------------------------------------------------- Bradley-Terry reward loss

def paper_reward_loss(rw, rl, margin, c):
    "Bradley-Terry NLL with Llama 2's margin and Eisenstein et al.'s centring term, pair by pair (float64)."
    bt = [np.log1p(np.exp(-(rw[i] - rl[i] - (0 if margin is None else margin[i])))) for i in range(len(rw))]
    centre = [0.0 if c is None else c * (rw[i] + rl[i]) ** 2 for i in range(len(rw))]
    return np.mean(bt) + np.mean(centre)


def trl_port_reward_loss(rw, rl, margin, c):
    "TRL 1.16 RewardTrainer.compute_loss, line by line in NumPy (logsigmoid as -log1p(exp(-x)))."
    logsig = lambda x: -np.logaddexp(0, -x)
    loss = -logsig(rw - rl - margin).mean() if margin is not None else -logsig(rw - rl).mean()
    if c is not None: loss += c * np.mean((rw + rl) ** 2)
    return loss


def trl_reward_loss(rw, rl, margin, c):
    "(loss, d loss / d rewards_chosen, d / d rewards_rejected, metrics) from TRL's own compute_loss."
    rw_t, rl_t = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (rw, rl))
    model = lambda **kw: SimpleNamespace(logits=torch.cat([rw_t, rl_t]).unsqueeze(-1))
    inputs = {"attention_mask": torch.ones(2 * len(rw), 3)}
    if margin is not None: inputs["margin"] = torch.tensor(margin, dtype=torch.float64)
    me = _trainer(args=SimpleNamespace(center_rewards_coefficient=c))
    loss = trl_reward.RewardTrainer.compute_loss(me, model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in me._metrics["train"].items()}
    return loss.item(), rw_t.grad.numpy(), rl_t.grad.numpy(), metrics


@pytest.mark.parametrize("with_margin,c", [(False, None), (True, None), (False, 0.01), (True, 0.3)])
def test_reward_loss_equals_the_paper_and_trl(with_margin, c):
    rng = np.random.default_rng(7)
    rw, rl = rng.normal(0.5, 2, 16), rng.normal(-0.5, 2, 16)
    margin = rng.uniform(0, 2, 16) if with_margin else None
    loss, metrics = reward_loss(rw, rl, margin, c)
    np.testing.assert_allclose(float(loss), paper_reward_loss(rw, rl, margin, c), rtol=1e-5)
    np.testing.assert_allclose(float(loss), trl_port_reward_loss(rw, rl, margin, c), rtol=1e-5)
    t_loss, t_gw, t_gl, t_metrics = trl_reward_loss(rw, rl, margin, c)
    np.testing.assert_allclose(float(loss), t_loss, rtol=1e-5)
    gw, gl = jax.grad(lambda a, b: reward_loss(a, b, margin, c)[0], argnums=(0, 1))(jnp.asarray(rw, jnp.float32),
                                                                                    jnp.asarray(rl, jnp.float32))
    np.testing.assert_allclose(np.asarray(gw), t_gw, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gl), t_gl, rtol=1e-4, atol=1e-7)
    for k in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        np.testing.assert_allclose(float(metrics[k]), t_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_reward_loss_gradient_by_finite_differences():
    "The gradient of the paper's formula, by central differences in float64, equals jax.grad (margin and centring on)."
    rng = np.random.default_rng(1)
    rw, rl, m = rng.normal(0, 1, 5), rng.normal(0, 1, 5), rng.uniform(0, 1, 5)
    g = np.asarray(jax.grad(lambda a: reward_loss(a, rl, m, 0.1)[0])(jnp.asarray(rw, jnp.float32)))
    eps, fd = 1e-6, np.zeros(5)
    for i in range(5):
        e = np.zeros(5); e[i] = eps
        fd[i] = (paper_reward_loss(rw + e, rl, m, 0.1) - paper_reward_loss(rw - e, rl, m, 0.1)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- KTO

def paper_kto(r, labels, kl_r, beta, lam_d, lam_u, z0=None):
    "Ethayarajh et al. 2024, Eq. 7-8: E[lambda_y - v(x, y)], z0 = max(0, mean mismatched log-ratio) unless given."
    z0 = max(0.0, float(np.mean(kl_r))) if z0 is None else z0
    sig = lambda v: 1 / (1 + np.exp(-v))
    v = [lam_d * sig(beta * (r[i] - z0)) if labels[i] else lam_u * sig(beta * (z0 - r[i])) for i in range(len(r))]
    return np.mean([(lam_d if labels[i] else lam_u) - v[i] for i in range(len(r))])


def trl_port_kto(pol, ref, labels, pol_kl, ref_kl, beta, lam_d, lam_u):
    "TRL 1.16 KTOTrainer.get_batch_loss_metrics' loss lines in NumPy: chosen losses, then rejected, concatenated, nanmean."
    kl = max(np.mean(pol_kl - ref_kl), 0.0)
    sig = lambda v: 1 / (1 + np.exp(-v))
    chosen = 1 - sig(beta * ((pol - ref)[labels] - kl))
    rejected = 1 - sig(beta * (kl - (pol - ref)[~labels]))
    return np.nanmean(np.concatenate([lam_d * chosen, lam_u * rejected]))


def trl_kto(per_token, ref_logps, labels, kl_per_token, ref_kl_logps, beta, lam_d, lam_u):
    "(loss, d loss / d per-token policy log-probs, d / d mismatched per-token log-probs, metrics) from TRL's _compute_loss."
    B, T = per_token.shape
    lp = torch.tensor(per_token, dtype=torch.float64, requires_grad=True)
    kl_lp = torch.tensor(kl_per_token, dtype=torch.float64, requires_grad=True)
    ids, kl_ids = torch.zeros(B, T + 1, dtype=torch.long), torch.ones(B, T + 1, dtype=torch.long)
    def model(input_ids, **kw):   # TRL's fused head returns log-probs [B, T] of tokens 1..T (0 where labels are -100)
        x = kl_lp if input_ids is kl_ids else lp
        return SimpleNamespace(log_probs=x, entropy=torch.zeros(B, T), mean_logits=torch.zeros(B, T))
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T + 1), "completion_mask": torch.ones(B, T + 1),
             "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones(B, T + 1), "KL_completion_mask": torch.ones(B, T + 1),
             "label": torch.tensor(labels), "ref_logps": torch.tensor(ref_logps), "ref_KL_logps": torch.tensor(ref_kl_logps)}
    me = _trainer(calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=beta, desirable_weight=lam_d,
                  undesirable_weight=lam_u, aux_loss_enabled=False)
    me._compute_kl_logps = lambda m, b: trl_kto_trainer.KTOTrainer._compute_kl_logps(me, m, b)   # TRL's, under no_grad
    loss = trl_kto_trainer.KTOTrainer._compute_loss(me, model, batch, False)
    loss.backward()
    return loss.item(), lp.grad.numpy(), None if kl_lp.grad is None else kl_lp.grad.numpy(), \
        {k: v[-1] for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("beta,lam_d,lam_u", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.8, 1.0)])
def test_kto_equals_the_paper_and_trl_with_padding(beta, lam_d, lam_u):
    rng = np.random.default_rng(int(beta * 10))
    B, T = 10, 7
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float64)            # right-padded replies
    per_token = np.where(mask > 0, -np.abs(rng.normal(1, 1, (B, T))), 0.0)
    kl_mask = mismatched(mask)                                                    # prompt i with reply i-1
    kl_per_token = np.where(kl_mask > 0, -np.abs(rng.normal(1, 1, (B, T))), 0.0)
    ref = per_token.sum(1) + rng.normal(0, 3, B)
    ref_kl = kl_per_token.sum(1) + rng.normal(-1, 2, B)
    labels = rng.random(B) < 0.5; labels[:2] = (True, False)
    garbage = lambda x, m: np.where(m > 0, x, rng.normal(0, 50, x.shape))        # padding must never count
    pol_s, _ = sequence_logps(jnp.asarray(garbage(per_token, mask)), jnp.asarray(mask))
    kl_s, _ = sequence_logps(jnp.asarray(garbage(kl_per_token, kl_mask)), jnp.asarray(kl_mask))
    kw = dict(beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u)
    loss, metrics = kto_loss(pol_s, ref, labels, kl_s, ref_kl, **kw)
    pol64, kl64 = per_token.sum(1), kl_per_token.sum(1)
    np.testing.assert_allclose(float(loss), paper_kto(pol64 - ref, labels, kl64 - ref_kl, beta, lam_d, lam_u), rtol=1e-5)
    np.testing.assert_allclose(float(loss), trl_port_kto(pol64, ref, labels, kl64, ref_kl, beta, lam_d, lam_u), rtol=1e-5)
    t_loss, t_grad, t_kl_grad, t_metrics = trl_kto(per_token, ref, labels, kl_per_token, ref_kl, beta, lam_d, lam_u)
    np.testing.assert_allclose(float(loss), t_loss, rtol=1e-5)
    # gradients with respect to the per-token log-probs, through sequence_logps's mask: TRL's, and none to the KL pairs
    def f(lp, klp):
        return kto_loss(sequence_logps(lp, mask)[0], ref, labels, sequence_logps(klp, kl_mask)[0], ref_kl, **kw)[0]
    g, g_kl = jax.grad(f, argnums=(0, 1))(jnp.asarray(per_token, jnp.float32), jnp.asarray(kl_per_token, jnp.float32))
    np.testing.assert_allclose(np.asarray(g), t_grad * mask, rtol=1e-4, atol=1e-8)
    assert t_kl_grad is None or not t_kl_grad.any()
    assert not np.asarray(g_kl).any()
    # the paper's formula with z0 held fixed (not differentiated), by central differences, per reply
    z0 = float(metrics["kl"]); eps, fd = 1e-6, np.zeros(B)
    for i in range(B):
        e = np.zeros(B); e[i] = eps
        fd[i] = (paper_kto(pol64 + e - ref, labels, None, beta, lam_d, lam_u, z0)
                 - paper_kto(pol64 - e - ref, labels, None, beta, lam_d, lam_u, z0)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(g)[:, 0], fd, rtol=1e-4, atol=1e-8)
    for ours, theirs in (("kl", "kl"), ("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                         ("rewards/margins", "rewards/margins"), ("logps/chosen", "logps/chosen"),
                         ("logps/rejected", "logps/rejected")):
        np.testing.assert_allclose(float(metrics[ours]), t_metrics[theirs], rtol=1e-5, atol=1e-6, err_msg=ours)


def test_kto_reference_point_is_clamped_at_zero():
    "A negative KL estimate (the mismatched pairs more likely under the reference) is 0 in the loss, as in the paper and TRL."
    rng = np.random.default_rng(2)
    pol, ref = rng.normal(-10, 2, 6), rng.normal(-10, 2, 6)
    labels = np.array([True, False] * 3)
    kl_pol, kl_ref = rng.normal(-12, 1, 6), rng.normal(-8, 1, 6)                     # mean log-ratio about -4
    loss, m = kto_loss(pol, ref, labels, kl_pol, kl_ref)
    assert float(m["kl"]) == 0.0
    np.testing.assert_allclose(float(loss), paper_kto(pol - ref, labels, None, 0.1, 1.0, 1.0, z0=0.0), rtol=1e-5)
    np.testing.assert_allclose(float(loss), trl_port_kto(pol, ref, labels, kl_pol, kl_ref, 0.1, 1.0, 1.0), rtol=1e-5)
