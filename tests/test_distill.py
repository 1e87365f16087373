"""`maxpost distill` (chapter 15d): the on-policy loss is the per-token reverse KL over the whole vocabulary, the
offline top-k path is the online one when k is the vocabulary, a teacher of another vocabulary is refused with exit 2,
and a tiny run trains, evaluates the teacher and resumes to the same weights and metrics."""
import json
import jax, jax.numpy as jnp, numpy as np
import pytest
from flax import nnx

from maxpost import tasks
from maxpost.checkpoint import save_hf, checkpoint_manager, restore_state
from maxpost.cli import main as cli_main
from maxpost.config import ConfigError, load_config
from maxpost.data import PromptIterator
from maxpost.model import create_model, get_model_config
from maxpost.policy import setup_run
from maxpost.rundir import read_metrics
from maxpost.distill import (dataset_batch, distill_examples, distill_micro_loss, read_teacher_topk, write_teacher_topk)

SMALL = ["load_parameters_path=", "model_overrides={num_layers: 1}", "train_split=train[:64]", "eval_split=test[:8]",
         "max_prompt_length=96", "max_completion_length=64", "global_batch_size=4", "eval_num_prompts=8", "eval_k=0",
         "log_period=1", "warmup_steps=0", "learning_rate=1e-3"]


def _teacher(path, seed=1, **overrides):
    "A tiny one-layer decoder saved as a Hugging Face directory with the embedded tokenizer."
    save_hf(create_model(get_model_config("tiny", num_layers=1, **overrides), seed=seed), path)
    tasks.build_tokenizer(path)
    return path


def _naive_reverse_kl(student, teacher, b):
    "Token mean over the completion mask of sum_v q_v (log q_v - log p_v), each row's logits by a plain forward pass, float64."
    total, n = 0.0, 0
    for i in range(len(b["prompt_ids"])):
        keep = b["prompt_mask"][i] > 0
        seq = np.concatenate([b["prompt_ids"][i][keep], b["completion_ids"][i]])[None]
        P = int(keep.sum())
        zs, zt = (np.asarray(m(jnp.asarray(seq)), np.float64)[0] for m in (student, teacher))
        for t in np.nonzero(b["completion_mask"][i])[0]:
            q = zs[P + t - 1] - np.logaddexp.reduce(zs[P + t - 1])
            p = zt[P + t - 1] - np.logaddexp.reduce(zt[P + t - 1])
            total += float((np.exp(q) * (q - p)).sum()); n += 1
    return total / n


def _batch(rng, B=4, P=12, T=10, vocab=512):
    "Left-padded prompts of different lengths, completions with a ragged mask."
    prompt_ids = rng.integers(1, vocab, (B, P)).astype(np.int32)
    prompt_mask = np.ones((B, P), np.int32)
    for i in range(B): prompt_mask[i, :i * 2] = 0
    prompt_ids = np.where(prompt_mask > 0, prompt_ids, 0)
    completion_ids = rng.integers(1, vocab, (B, T)).astype(np.int32)
    completion_mask = (np.arange(T)[None] < np.array([T, 7, 3, 9])[:, None]).astype(np.int32)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask)


@pytest.mark.parametrize("chunk", [0, 4, 16])
def test_on_policy_loss_is_the_naive_per_token_reverse_kl_over_the_vocabulary(tmp_path, chunk):
    """Catches: the KL's direction swapped (forward for reverse), the logit row off by one position, the mask or the
    left padding ignored, a chunk boundary that drops or double-counts tokens, a token mean over the wrong count."""
    student = create_model(get_model_config("tiny", num_layers=1), seed=0)
    teacher = create_model(get_model_config("tiny", num_layers=1), seed=1)
    b = _batch(np.random.default_rng(0))
    cfg = load_config("distill", [f"base_output_directory={tmp_path}", "teacher_path=t", f"logits_chunk_size={chunk}"])
    loss, m = distill_micro_loss(cfg, teacher)(student, b, None)
    want = _naive_reverse_kl(student, teacher, b)
    np.testing.assert_allclose(float(loss), want, rtol=2e-4)
    np.testing.assert_allclose(float(m["reverse_kl_sum"] / m["num_tokens"]), want, rtol=2e-4)
    assert float(m["num_tokens"]) == b["completion_mask"].sum()
    # the student learns, the teacher does not: the gradient of the teacher's weights is zero
    g = nnx.grad(lambda t: distill_micro_loss(cfg, t)(student, b, None)[0])(teacher)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(nnx.state(g, nnx.Param)))


def test_offline_topk_with_k_the_vocabulary_is_the_online_loss(tmp_path):
    """The file `maxpost distill write-topk` writes at k = V, read back, gives the online forward KL of the same
    completions, value and gradient. Catches: top-k rows stored at shifted positions, ids and log-probs out of step, the
    temperature applied on one side only, the tail bin added when nothing is outside the top k."""
    hf = _teacher(tmp_path / "teacher")
    args = [f"base_output_directory={tmp_path}", f"teacher_path={hf}", *SMALL, "distill_temperature=1.5"]
    off = load_config("distill", args + ["mode=offline", "offline_k=512", "offline_examples=4", "run_name=topk"])
    s = setup_run(off, models={"teacher": str(hf)})
    path = write_teacher_topk(off, s)
    arrays, meta = read_teacher_topk(path)
    assert meta["vocab_size"] == 512 and arrays["topk_ids"].shape == (4, 64, 512)
    on = load_config("distill", args + ["mode=supervised"])
    first = PromptIterator(distill_examples(on, on.train_split), seed=on.seed).next(4)   # the trainer's first draw
    b = dataset_batch(on, s.tokenizer, first)
    for k in b: np.testing.assert_array_equal(arrays[k], b[k])
    file_batch = arrays
    student, teacher = s.model, s.models["teacher"]
    online = lambda st: distill_micro_loss(on, teacher)(st, b, None)
    offline = lambda st: distill_micro_loss(off)(st, file_batch, None)
    (l_on, _), g_on = nnx.value_and_grad(online, has_aux=True)(student)
    (l_off, _), g_off = nnx.value_and_grad(offline, has_aux=True)(student)
    np.testing.assert_allclose(float(l_off), float(l_on), rtol=1e-4)
    for x, y in zip(jax.tree.leaves(nnx.state(g_off, nnx.Param)), jax.tree.leaves(nnx.state(g_on, nnx.Param))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-3, atol=1e-6)


def test_teacher_with_another_vocabulary_exits_2_naming_both(tmp_path, capsys):
    "Catches: a teacher of another vocabulary loaded and compared position by position (or a traceback instead of exit 2)."
    hf = _teacher(tmp_path / "big", vocab_size=1024)
    code = cli_main(["distill", f"base_output_directory={tmp_path}", f"teacher_path={hf}", *SMALL, "steps=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "1024" in err and "512" in err and "vocabulary" in err, err
    assert not (tmp_path / "embedded-distill-on_policy" / "checkpoints").exists()


def test_tiny_distill_runs_evaluates_the_teacher_and_resumes_exactly(tmp_path, capsys):
    """`maxpost distill` end to end (on-policy, the student sampling), then a run stopped after 2 of 4 steps and started
    again: the same weights and train metrics as the run in one go. Catches: a sampling seed or GKD coin not drawn from
    the step, a prompt order not restored, the teacher's pass@1 missing from the first evaluation."""
    hf = _teacher(tmp_path / "teacher")
    run = lambda name, steps, *extra: cli_main(["distill", f"base_output_directory={tmp_path}", f"teacher_path={hf}",
                                                *SMALL, f"run_name={name}", f"steps={steps}", "checkpoint_period=2", *extra])
    assert run("whole", 4, "mode=gkd", "lmbda=0.5") == 0
    out = capsys.readouterr().out
    assert "teacher: pass@1" in out and "top1_agreement=" in out
    assert run("parts", 2, "mode=gkd", "lmbda=0.5") == 0 and run("parts", 4, "mode=gkd", "lmbda=0.5") == 0
    whole, parts = read_metrics(tmp_path / "whole", "train"), read_metrics(tmp_path / "parts", "train")
    assert [r["step"] for r in whole] == [1, 2, 3, 4] and [r["step"] for r in parts][-2:] == [3, 4]
    keys = ("loss", "reverse_kl", "forward_kl", "top1_agreement", "grad_norm", "student_sampled")
    for x, y in zip(whole[2:], parts[-2:]): assert {k: x[k] for k in keys} == {k: y[k] for k in keys}, (x, y)
    assert {r["student_sampled"] for r in whole} == {0.0, 1.0}     # lmbda 0.5: both sources within 4 steps
    ev = read_metrics(tmp_path / "whole", "eval")
    assert ev[0]["step"] == 0 and "teacher_pass@1" in ev[0] and "pass@1" in ev[-1] and ev[-1]["step"] == 4
    like = nnx.state(create_model(get_model_config("tiny", num_layers=1)), nnx.Param)
    a = restore_state(checkpoint_manager(tmp_path / "whole" / "checkpoints"), like)[0]
    b = restore_state(checkpoint_manager(tmp_path / "parts" / "checkpoints"), like)[0]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)): np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_prompts_without_completions_serve_on_policy_but_not_the_dataset_modes(tmp_path):
    "Catches: on-policy (or teacher-written) distillation of a task of prompts and answers only, such as reasoning-gym's, refused for want of dataset completions it never trains on; or a mode that trains on dataset completions handed None instead of the one-line error."
    d = tmp_path / "qa"; d.mkdir()
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    for split in ("train", "test"): (d / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    base = [f"base_output_directory={tmp_path}", "teacher_path=t", f"dataset_name={d}", "eval_split=test"]
    for extra in (["mode=on_policy"], ["mode=supervised", "completion_source=teacher"],
                  ["mode=offline", "completion_source=teacher"]):
        cfg = load_config("distill", base + extra)
        got = distill_examples(cfg, "train")
        assert [r["question"] for r in got] == [r["question"] for r in rows], extra
        assert all(r["completion"] is None for r in got), extra
    for extra in (["mode=gkd"], ["mode=supervised"], ["mode=offline"]):
        with pytest.raises(ConfigError, match="completion_column="):
            distill_examples(load_config("distill", base + extra), "train")


@pytest.mark.parametrize("mode", ["on_policy", "supervised", "offline"])
def test_the_step_compiles_ahead_and_is_the_program_used(tmp_path, mode):
    "The distillation step starts compiling on a thread when the trainer is built (before the first evaluation), from a batch's shapes: prompts and completions padded to their maximum lengths online, the file's first rows offline; the first steps take that program (nothing compiled again, nothing left pending)."
    from maxpost.commands import start_trainer
    from maxpost.distill import DistillTrainer
    hf = _teacher(tmp_path / "teacher")
    args = [f"base_output_directory={tmp_path}", f"teacher_path={hf}", *SMALL, f"mode={mode}", "steps=2",
            "eval_num_prompts=0", f"run_name={mode}"]
    if mode == "offline":
        off = load_config("distill", args + ["offline_k=8", "offline_examples=8"])
        write_teacher_topk(off, setup_run(off, models={"teacher": str(hf)}))
        args += ["offline_k=8", "offline_examples=8"]
    tr = start_trainer(DistillTrainer, load_config("distill", args), progress=False)
    assert len(tr.step_fn.ahead) == 1
    tr.fit(progress=False)
    assert tr.step_fn.ahead == {} and len(tr.step_fn.programs) == 1
