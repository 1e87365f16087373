"""KTO as `maxpost dpo loss_type=kto` (issue 51 item 4): the trainer's step against the KTO loss ported to NumPy from
TRL's KTOTrainer, on the tiny model's own log-probs; paired data unpaired as TRL unpairs it; bad input refused in one
line."""
import json, random, subprocess, sys

import jax, numpy as np, pytest
from flax import nnx

from maxpost import tasks
from maxpost.commands import start_trainer
from maxpost.config import ConfigError, load_config
from maxpost.dpo import DPOTrainer, ExampleData, embedded_pair, unpair
from maxpost.sampling import completion_logps

TINY = ["load_parameters_path=", "model_overrides={num_layers: 2, d_model: 64, mlp_dim: 128}", "max_prompt_length=64",
        "max_completion_length=64", "train_split=train[:64]", "eval_split=test[:8]", "eval_batches=1",
        "eval_num_prompts=0", "log_period=1", "warmup_steps=0"]


def _logp(model, prompt_ids, completion_ids) -> float:
    "Summed log-prob of one reply after its prompt, the row alone through the model (no padding, no shared prompt)."
    p, c = np.asarray([prompt_ids], np.int32), np.asarray([completion_ids], np.int32)
    return float(np.asarray(completion_logps(model, p, np.ones_like(p), c, np.ones_like(c))).astype(np.float64).sum())


def trl_kto_loss(policy, reference, labels, policy_kl, reference_kl, beta, desirable_weight, undesirable_weight):
    """TRL's KTO loss and metrics, ported to NumPy in float64 from `KTOTrainer._compute_loss` (trl/trainer/kto_trainer.py,
    TRL 1.16, loss_type="kto"): kl = mean(KL_logps - ref_KL_logps), detached, clamped at 0; chosen losses
    1 - sigmoid(beta (logratio - kl)), rejected 1 - sigmoid(beta (kl - logratio)); the loss is the mean of the
    desirable_weight- and undesirable_weight-scaled losses over all examples; rewards = beta * logratio, averaged
    per kind."""
    sig = lambda x: 1 / (1 + np.exp(-x))
    labels = np.asarray(labels, bool)
    kl = max(float(np.mean(np.asarray(policy_kl) - np.asarray(reference_kl))), 0.0)
    ratio = np.asarray(policy) - np.asarray(reference)
    chosen = 1 - sig(beta * (ratio[labels] - kl))
    rejected = 1 - sig(beta * (kl - ratio[~labels]))
    losses = np.concatenate([desirable_weight * chosen, undesirable_weight * rejected])
    return losses.mean(), {"kl": kl, "rewards/chosen": (beta * ratio[labels]).mean(),
                           "rewards/rejected": (beta * ratio[~labels]).mean(),
                           "logps/chosen": np.asarray(policy)[labels].mean()}


@pytest.mark.parametrize("beta,wd,wu", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33)])
def test_kto_step_loss_equals_trl_formula_on_the_models_own_logps(tmp_path, beta, wd, wu):
    """After two steps (the policy has moved from its reference), the trainer's KTO step on examples [5, 2, 7, 0]
    (labels F, T, F, T: the embedded pairs unpaired) reports the loss and metrics that TRL's formula gives on
    log-probs computed here one row at a time: each example's reply under policy and reference, and the KL point
    from each prompt with the reply of the example before it in the batch (TRL's rotation), the first with the
    last's."""
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=kto", "loss_type=kto", f"beta={beta}",
                              f"desirable_weight={wd}", f"undesirable_weight={wu}", "global_batch_size=4",
                              "learning_rate=3e-3", *TINY], base=None)
    tr = start_trainer(DPOTrainer, cfg, progress=False)
    tr.train_step(); tr.train_step()
    idx = [5, 2, 7, 0]
    ex = [tr.train_data.encoded(i) for i in idx]
    labels = [e["label"] for e in ex]
    assert labels == [False, True, False, True]
    pol, ref = (nnx.merge(tr.graphdef, p, tr.rest) for p in (tr.params, tr.ref_params))
    own = [[_logp(m, e["prompt_ids"], e["completion_ids"]) for e in ex] for m in (pol, ref)]
    other = [[_logp(m, e["prompt_ids"], ex[k - 1]["completion_ids"]) for k, e in enumerate(ex)] for m in (pol, ref)]
    want, want_m = trl_kto_loss(own[0], own[1], labels, other[0], other[1], beta, wd, wu)
    assert want_m["kl"] > 1e-3, want_m      # the reference point is not clamped away: it enters the loss
    got = tr.update(tr.batch_of(tr.train_data, idx))
    np.testing.assert_allclose(got["loss"], want, rtol=1e-5, atol=1e-6)
    for k, v in want_m.items(): np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-5, err_msg=k)
    assert (got["count/chosen"], got["count/rejected"]) == (2, 2)


def test_paired_data_is_unpaired_as_trl_unpairs_it():
    """Each pair gives its prompt with the chosen reply labelled True and with the rejected reply labelled False:
    the same multiset of rows as TRL's `unpair_preference_dataset` (after `maybe_extract_prompt` for pairs with an
    implicit prompt, as KTOTrainer does)."""
    datasets = pytest.importorskip("datasets")
    trl_data = pytest.importorskip("trl.data_utils")
    rng = random.Random(0)
    rows = [{k: p[k] for k in ("prompt", "chosen", "rejected")}
            for p in (embedded_pair(r, rng, hasty_error_rate=0.5) for r in tasks.generate_problems(6, seed=2))]
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    key = lambda e: json.dumps({k: e[k] for k in ("prompt", "completion", "label")}, sort_keys=True)
    for data in (rows, implicit):
        theirs = datasets.Dataset.from_list(data)
        if "prompt" not in data[0]: theirs = theirs.map(trl_data.maybe_extract_prompt)
        theirs = trl_data.unpair_preference_dataset(theirs)
        ours = unpair(data)
        assert sorted(map(key, ours)) == sorted(map(key, theirs)) and len(ours) == 2 * len(data)
    assert [e["label"] for e in unpair(rows)] == [True, False] * len(rows)


def test_the_embedded_pairs_train_kto_with_no_data_arguments(tmp_path):
    "`maxpost dpo loss_type=kto` reads the embedded task's pairs, unpaired: twice as many examples, half desirable."
    cfg = load_config("dpo", [f"base_output_directory={tmp_path}", "run_name=k", "loss_type=kto", *TINY], base=None)
    assert load_config("dpo", ["loss_type=kto"]).run_name == "embedded-kto"
    tr = start_trainer(DPOTrainer, cfg, progress=False)
    assert isinstance(tr.train_data, ExampleData) and len(tr.train_data) == 128 and tr.train_data.labels.sum() == 64
    m = tr.train_step()
    assert abs(m["loss"] - 0.5) < 1e-5 and m["kl"] == 0.0            # at the reference: half of each weight


@pytest.mark.parametrize("args,word", [
    (["desirable_weight=1.33"], "desirable_weight=1.33 has no effect with loss_type='sigmoid'"),
    (["loss_type=ipo", "undesirable_weight=2"], "undesirable_weight=2.0 has no effect with loss_type='ipo'"),
    (["label_column=ok"], "label_column=ok has no effect"),
    (["loss_type=kto", "label_smoothing=0.1"], "label_smoothing=0.1 has no effect with loss_type='kto'"),
    (["loss_type=kto", "precompute_ref_log_probs=true"], "precompute_ref_log_probs=True has no effect with loss_type='kto'"),
    (["loss_type=kto", "global_batch_size=4", "gradient_accumulation_steps=4"], "fewer than 2 examples"),
])
def test_kto_keys_and_batches_refused(tmp_path, args, word):
    with pytest.raises(ConfigError) as e:
        load_config("dpo", [f"base_output_directory={tmp_path}", *args])
    assert word in str(e.value), str(e.value)


def _cli(base, *args):
    return [sys.executable, "-m", "maxpost.cli", "dpo", f"base_output_directory={base}", *args]


def _refused_in_one_line(r, word):
    "Exit 2, no traceback, and the refusal one line of stderr (after the run's start line, when it got that far)."
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert [l for l in lines if word in l] == [lines[-1]] and lines[-1].startswith("maxpost dpo: "), r.stderr[-3000:]


def test_cli_bad_kto_input_exits_2_in_one_line(tmp_path):
    """Labels that are not booleans, a split with no undesirable or no desirable example, and a KTO key under DPO: exit 2, one line
    on stderr naming the problem, nothing trained."""
    tasks.build_tokenizer().save_pretrained(tmp_path / "tok")
    good = [{"prompt": f"What is {i} + 1?", "completion": f"It is {i + 1 + i % 2}.", "label": i % 2 == 0} for i in range(6)]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in good))
    cases = {"yes": ([*good[:3], {**good[3], "label": "yes"}, *good[4:]], "row 3 (counting from 0): column 'label' holds 'yes', not a boolean"),
             "ints": ([{**g, "label": int(g["label"])} for g in good], "column 'label' holds 1, not a boolean"),
             "all": ([{**g, "label": True} for g in good], "none is undesirable (label false)"),
             "none": ([{**g, "label": False} for g in good], "none is desirable (label true)")}
    common = [f"tokenizer_path={tmp_path / 'tok'}", "load_parameters_path=", "model_overrides={num_layers: 1}",
              "global_batch_size=2", "steps=1", "eval_num_prompts=0", "loss_type=kto", f"eval_dataset_name={held}",
              "eval_split=train"]
    for name, (rows, word) in cases.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        r = subprocess.run(_cli(tmp_path / "out", f"dataset_name={data}", *common), capture_output=True, text=True, timeout=600)
        _refused_in_one_line(r, word)
    r = subprocess.run(_cli(tmp_path / "out", "desirable_weight=2"), capture_output=True, text=True, timeout=300)
    _refused_in_one_line(r, "desirable_weight=2.0 has no effect with loss_type='sigmoid'")
    assert not list((tmp_path / "out").glob("*/checkpoints/*"))


KTO_ARGS = {"beta": (0.1, 0.7), "desirable_weight": (1.0, 1.5), "undesirable_weight": (1.0, 2.0),
            "label_smoothing": (0.0, 0.2), "lambda_orpo": (0.1, 0.9), "simpo_gamma": (0.5, 2.0)}


@pytest.mark.parametrize("key", sorted(KTO_ARGS))
def test_a_key_is_accepted_under_kto_exactly_when_kto_loss_reads_it(tmp_path, key):
    """Measured, not declared (as tests/test_first_hour_round4.py does for the paired losses): a key moved from its
    default is accepted with loss_type=kto exactly when moving it moves `kto_loss` on random inputs (a key kto_loss
    has no argument for does not), and refused in one line otherwise."""
    import inspect
    from maxpost.preference_loss import kto_loss
    rng = np.random.default_rng(0)
    pol, ref, pk, rk = (-rng.uniform(5, 30, 6).astype(np.float32) for _ in range(4))
    labels = np.array([1, 0, 1, 1, 0, 0], bool)
    a, b = KTO_ARGS[key]
    reads = key in inspect.signature(kto_loss).parameters and not np.isclose(
        *[float(kto_loss(pol, ref, labels, pk, rk, **{key: v})[0]) for v in (a, b)], rtol=1e-6, atol=0)
    args = [f"base_output_directory={tmp_path}", "loss_type=kto", f"{key}={b}"]
    assert reads == (key in ("beta", "desirable_weight", "undesirable_weight"))
    if reads: assert getattr(load_config("dpo", args), key) == b
    else:
        with pytest.raises(ConfigError, match=f"{key}=.* has no effect with loss_type='kto'"): load_config("dpo", args)
