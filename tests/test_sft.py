"""SFT end to end: gradient accumulation, packing, resume after a kill, bad columns, non-finite loss, the CLI,
a Hugging Face starting checkpoint, and the papermill run."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, optax, pytest
from flax import nnx

from maxpost.config import load_config, run_dir, ConfigError
from maxpost.model import get_model_config, create_model
from maxpost.sft import make_sft_step, train_sft
from maxpost.sft_loss import sft_loss
from maxpost.optimizer import make_optimizer
from maxpost.rundir import read_metrics
from maxpost.checkpoint import checkpoint_manager, restore_state
from maxpost import sharding

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["model_name=tiny", "train_split=train[:256]", "eval_split=test[:16]", "global_batch_size=8", "max_target_length=96", "log_period=1", "eval_batches=1",
         "warmup_steps=2", "learning_rate=3e-3"]


def tiny_model(vocab=64):
    return create_model(get_model_config("tiny", num_layers=1, d_model=64, mlp_dim=128, vocab_size=vocab,
                                         num_heads=2, num_kv_heads=1), seed=0)


def random_batch(rng, b=8, t=24, vocab=64):
    seg = np.ones((b, t), np.int32)
    pos = np.tile(np.arange(t), (b, 1))
    for r in range(b):  # pack 1-3 segments per row, the tail padding
        cuts = sorted(rng.choice(np.arange(4, t - 2), size=rng.integers(0, 3), replace=False))
        edges = [0, *cuts, t - rng.integers(0, 4)]
        seg[r] = 0
        for s, (a, z) in enumerate(zip(edges[:-1], edges[1:]), start=1):
            seg[r, a:z], pos[r, a:z] = s, np.arange(z - a)
    return {"tokens": rng.integers(1, vocab, (b, t)).astype(np.int32), "segment_ids": seg, "positions": pos,
            "loss_mask": (rng.random((b, t)) < 0.5).astype(np.int32)}


@pytest.mark.parametrize("accum", [2, 4, 8])
def test_gradient_accumulation_equals_one_big_batch(accum):
    model = tiny_model()
    gd, p0, rest = nnx.split(model, nnx.Param, ...)
    batch = random_batch(np.random.default_rng(accum))
    tx = optax.sgd(1.0)  # parameters move by exactly the gradient
    # reference: the gradient of the token-mean loss of the whole batch, by plain autodiff
    def big_loss(p):
        logits = nnx.merge(gd, p, rest)(batch["tokens"], batch["positions"], batch["segment_ids"])
        return sft_loss(logits, batch)[0]
    ref_grads = jax.jit(jax.grad(big_loss))(p0)
    ref_params = jax.tree.map(lambda p, u: p + u, p0, tx.update(ref_grads, tx.init(p0), p0)[0])
    step = make_sft_step(gd, tx, accum=accum)
    p = jax.tree.map(jnp.copy, p0)
    p, _, metrics = step(p, rest, tx.init(p), batch)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], big_loss(p0), rtol=1e-5)


def test_packed_equals_unpacked_loss():
    model = tiny_model()
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, 64, n) for n in (7, 5, 9)]
    masks = [(rng.random(len(s)) < 0.6).astype(np.int32) for s in seqs]
    L = 24
    packed = {k: np.zeros((1, L), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    at = 0
    for i, (s, m) in enumerate(zip(seqs, masks), start=1):
        n = len(s)
        packed["tokens"][0, at:at + n], packed["loss_mask"][0, at:at + n] = s, m
        packed["segment_ids"][0, at:at + n], packed["positions"][0, at:at + n] = i, np.arange(n)
        at += n
    logits = model(packed["tokens"], packed["positions"], packed["segment_ids"])
    loss_packed, m_packed = sft_loss(logits, packed)
    nll, count = 0.0, 0.0
    for s, m in zip(seqs, masks):
        one = {"tokens": s[None], "segment_ids": np.ones((1, len(s)), np.int32), "positions": np.arange(len(s))[None],
               "loss_mask": m[None]}
        _, mm = sft_loss(model(one["tokens"]), one)
        nll, count = nll + float(mm["nll_sum"]), count + float(mm["num_loss_tokens"])
    assert float(m_packed["num_loss_tokens"]) == count
    np.testing.assert_allclose(float(loss_packed), nll / count, rtol=1e-5)


def sft_cmd(base, run, steps, *extra):
    return [sys.executable, "-m", "maxpost.cli", "sft", f"base_output_directory={base}", f"run_name={run}",
            f"steps={steps}", *SMALL, *extra]


def final_params(base, run, like):
    mgr = checkpoint_manager(Path(base) / run / "checkpoints")
    return restore_state(mgr, like)[0], mgr.latest_step()


def test_cli_run_then_resume_after_kill_matches_uninterrupted(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    steps, extra = 24, ["checkpoint_period=4", "max_checkpoints_to_keep=3"]
    r = subprocess.run(sft_cmd(tmp_path, "whole", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval_loss=" in r.stdout
    # the same run, killed (SIGKILL, no chance to save) once its second checkpoint exists, then resumed
    p = subprocess.Popen(sft_cmd(tmp_path, "killed", steps, *extra), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    ck = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (ck / "8").exists() and p.poll() is None: time.sleep(0.01)
    p.send_signal(signal.SIGKILL); p.wait()
    done = sorted(int(d.name) for d in ck.iterdir() if d.name.isdigit())
    assert done and max(done) < steps, f"the run finished before it could be killed: {done}"
    r = subprocess.run(sft_cmd(tmp_path, "killed", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    like = nnx.state(create_model(get_model_config("tiny")), nnx.Param)
    a, sa = final_params(tmp_path, "whole", like)
    b, sb = final_params(tmp_path, "killed", like)
    assert sa == sb == steps
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)): np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    losses = [r["loss"] for r in read_metrics(tmp_path / "whole", "train")]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5
    # issue 21, item 16: the resumed run redid the steps after its checkpoint without duplicating their records
    assert [r["step"] for r in read_metrics(tmp_path / "killed", "train")] == list(range(1, steps + 1))


def test_sigterm_saves_a_checkpoint(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    p = subprocess.Popen(sft_cmd(tmp_path, "term", 100000, "checkpoint_period=100000"), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3): time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    # issue 21, item 9: a stopped run is not a finished one: exit 128 + SIGTERM, and say where it stopped
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err[-3000:])
    steps = [int(d.name) for d in (tmp_path / "term" / "checkpoints").iterdir() if d.name.isdigit()]
    assert len(steps) == 1 and 3 <= steps[0] < 100000
    assert f"stopped by SIGTERM at step {steps[0]} of 100000" in err and "resume" in err, err[-2000:]


def test_bad_column_is_a_clear_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"instruction": "hi", "output": "yo"}) for _ in range(4)))
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=bad", f"dataset_name={data}",
                              f"tokenizer_path={prepare_tokenizer(tmp_path)}", "steps=2", *SMALL, "train_split=train",
                              "eval_split=train", "eval_on_train=true"])   # a single file has one split
    with pytest.raises(ValueError) as e: train_sft(cfg, progress=False)
    assert "instruction" in str(e.value) and "output" in str(e.value)


def prepare_tokenizer(tmp_path):
    from maxpost.tasks import build_tokenizer
    d = tmp_path / "tok"
    build_tokenizer(d)
    return d


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    base = [f"base_output_directory={tmp_path}", "run_name=nan", "checkpoint_period=2", *SMALL]
    cfg = load_config("sft", base + ["steps=4"])
    train_sft(cfg, progress=False)
    like = nnx.state(create_model(get_model_config("tiny")), nnx.Param)
    good, step = final_params(tmp_path, "nan", like)
    # resume the same run with a learning rate that blows the weights up (optimizer settings may change on a resume)
    cfg = load_config("sft", base + ["steps=40", "learning_rate=1e30", "max_grad_norm=1e30", "warmup_steps=0"])
    with pytest.raises(FloatingPointError, match="non-finite (loss|weights).*last good"):
        train_sft(cfg, progress=False)
    after, step2 = final_params(tmp_path, "nan", like)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after))
    assert step2 >= step


def test_remat_policy_full_trains_like_none(tmp_path):
    """remat_policy=full changes memory, not the numbers: the same losses step by step, and the run records it."""
    losses = {}
    for policy in ("none", "full"):
        cfg = load_config("sft", [f"base_output_directory={tmp_path}", f"run_name={policy}", "steps=3",
                                  f"remat_policy={policy}", *SMALL])
        train_sft(cfg, progress=False)
        losses[policy] = [r["loss"] for r in read_metrics(run_dir(cfg), "train")]
        assert json.loads((run_dir(cfg) / "model_config.json").read_text())["remat"] == policy
    assert len(losses["none"]) == 3
    np.testing.assert_allclose(losses["full"], losses["none"], rtol=1e-5)
    with pytest.raises(ConfigError, match="remat_policy"):
        load_config("sft", [f"base_output_directory={tmp_path}", "run_name=x", "remat_policy=some"])


def test_start_from_a_hugging_face_checkpoint(tmp_path):
    import torch, transformers
    tok_dir = prepare_tokenizer(tmp_path)
    hf_cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.Qwen3ForCausalLM(hf_cfg).save_pretrained(hf_dir)
    for f in Path(tok_dir).iterdir(): (hf_dir / f.name).write_bytes(f.read_bytes())
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=fromhf", f"load_parameters_path={hf_dir}",
                              "steps=6", "save_hf=true", "remat_policy=full", *SMALL])
    out = train_sft(cfg, progress=False)
    assert out["step"] == 6
    # the run saved its model config (from the HF config) and a Hugging Face export that transformers loads
    mc = json.loads((run_dir(cfg) / "model_config.json").read_text())
    assert (mc["d_model"], mc["num_layers"], mc["head_dim"], mc["remat"]) == (64, 2, 32, "full")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir(cfg) / "hf")
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in transformers.Qwen3ForCausalLM(hf_cfg).parameters())


def test_papermill_sft_run(tmp_path):
    import papermill as pm
    out = tmp_path / "sft-out.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "runs" / "sft.ipynb"), str(out), cwd=str(tmp_path), kernel_name="python3",
                        parameters=dict(base_output_directory=str(tmp_path / "runs"), run_name="pm", steps=12,
                                        log_period=3), progress_bar=False)
    recs = read_metrics(tmp_path / "runs" / "pm", "train")
    assert recs[-1]["step"] == 12 and recs[-1]["loss"] < recs[0]["loss"]


def test_non_finite_loss_before_any_checkpoint_says_so(tmp_path):
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=nan0", "steps=3", *SMALL,
                              "learning_rate=1e30", "max_grad_norm=1e30", "warmup_steps=0"])
    with pytest.raises(FloatingPointError, match="No checkpoint had been saved yet"):
        train_sft(cfg, progress=False)


def test_dropped_examples_are_reported_and_too_many_stop_the_run(tmp_path, capsys):
    """issue 21, item 2: at max_target_length=64 almost every embedded conversation loses its whole answer."""
    base = [f"base_output_directory={tmp_path}", "run_name=short", "steps=2", *SMALL]
    with pytest.raises(ConfigError, match=r"dropped.*raise max_target_length") as e:
        train_sft(load_config("sft", base + ["max_target_length=64"]), progress=False)
    assert "of 256 examples" in str(e.value)
    assert not (tmp_path / "short" / "checkpoints").exists()          # refused before anything was trained
    train_sft(load_config("sft", base), progress=True)
    err = capsys.readouterr().err
    assert "train split: 256 examples" in err and "dropped" in err


def test_resume_refuses_a_changed_run_and_records_allowed_changes(tmp_path):
    """issue 21, item 7: config.yml is the run's record; a breaking change is refused by name; a safe one logged."""
    base = [f"base_output_directory={tmp_path}", "run_name=r", *SMALL]
    train_sft(load_config("sft", base + ["steps=2"]), progress=False)
    record = (tmp_path / "r" / "config.yml").read_text()
    with pytest.raises(ConfigError, match=r"train_split: 'train\[:256\]' -> 'train\[:128\]'"):
        train_sft(load_config("sft", [*base, "steps=4", "train_split=train[:128]"]), progress=False)
    with pytest.raises(ConfigError, match=r"model_overrides: \{\} -> \{.num_layers.: 2\}"):
        train_sft(load_config("sft", [*base, "steps=4", "model_overrides={num_layers: 2}"]), progress=False)
    with pytest.raises(ConfigError, match="global_batch_size: 8 -> 16"):
        train_sft(load_config("sft", [*base, "steps=4", "global_batch_size=16"]), progress=False)
    train_sft(load_config("sft", base + ["steps=4", "log_period=2"]), progress=False)
    assert (tmp_path / "r" / "config.yml").read_text() == record          # never overwritten
    hist = [json.loads(l) for l in (tmp_path / "r" / "config_history.jsonl").read_text().splitlines()]
    assert hist == [{"step": 2, "time": hist[0]["time"], "changed": {"steps": [2, 4], "log_period": [1, 2]}}]


def test_a_second_process_on_the_same_run_is_refused(tmp_path):
    """issue 21, item 10: an exclusive lock on the run directory; the second process exits 4 naming the first, and
    a killed holder's lock is taken over."""
    from maxpost.rundir import RunLock, RunLocked
    holder = subprocess.Popen([sys.executable, "-c", f"from maxpost.rundir import RunLock\nimport time\n"
                               f"with RunLock({str(tmp_path / 'busy')!r}): print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = subprocess.run(sft_cmd(tmp_path, "busy", 10), capture_output=True, text=True, timeout=300)
        assert r.returncode == 4, (r.returncode, r.stderr[-2000:])
        assert f"is in use by pid {holder.pid}" in r.stderr
        with pytest.raises(RunLocked):
            with RunLock(tmp_path / "busy"): pass
    finally:
        holder.kill(); holder.wait()
    with RunLock(tmp_path / "busy"):       # the kernel released the dead holder's flock
        assert (tmp_path / "busy" / ".lock").read_text().startswith(f"pid {os.getpid()}")


def test_a_step_that_cannot_fit_is_refused_before_it_runs(tmp_path):
    """issue 20, item 5: the step is compiled first and its memory analysis compared with the device's memory; a
    step that cannot fit stops with how much is missing and the knobs, instead of being killed by the kernel."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", MAXPOST_DEVICE_MEMORY="1000000")
    r = subprocess.run(sft_cmd(tmp_path, "big", 5), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "the SFT step needs" in r.stderr and "short by" in r.stderr and "remat_policy" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "big" / "checkpoints").exists() or not any((tmp_path / "big" / "checkpoints").iterdir())
    # with the memory it has, the same run prints what it needs next to what there is, and trains
    r = subprocess.run(sft_cmd(tmp_path, "fits", 2), env={**env, "MAXPOST_DEVICE_MEMORY": str(8 << 30)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "memory: the SFT step needs" in r.stderr and "of 8.00 GiB" in r.stderr, r.stderr[-2000:]


def test_the_run_saves_with_the_limit_of_its_own_state(tmp_path, monkeypatch):
    """A training run's checkpoint manager bounds what a save holds in flight by its state's largest array
    (`save_limit_gb`, nbs/03_checkpoint); without it Orbax writes the whole state at once, a second copy in RAM."""
    import maxpost.train as train_mod
    from maxpost.checkpoint import save_limit_gb
    built = []
    def recording(directory, **kw):
        built.append((Path(directory), kw.get("save_concurrent_gb")))
        return checkpoint_manager(directory, **kw)
    monkeypatch.setattr(train_mod, "checkpoint_manager", recording)
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=lim", "steps=2", *SMALL])
    train_sft(cfg, progress=False)
    like = nnx.state(create_model(get_model_config("tiny")), nnx.Param)
    expected = save_limit_gb(like, make_optimizer(cfg).init(like))
    assert (run_dir(cfg) / "checkpoints", expected) in built


def test_the_step_is_compiled_ahead_while_the_data_loads_and_only_once(tmp_path):
    """issue 47 item 3: the SFT step starts compiling on a thread before the data is prepared (the program the first
    step waits for, not a second compile); timing.json names it, with the eval step compiled after the first step."""
    from maxpost.commands import start_trainer
    from maxpost.sft import SFTTrainer
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=ahead", "steps=2", "compilation_cache_dir=", *SMALL])
    from maxpost.timing import compile_watch
    t0 = time.time()
    tr = start_trainer(SFTTrainer, cfg)
    # from random weights it starts from shapes, at the command's start (`EarlyPrograms`), and the constructor takes it
    assert len(tr.step_fn.early) == 1 and not tr.step_fn.ahead and not tr.step_fn.programs
    tr.fit(progress=False)
    assert len(tr.step_fn.programs) == 1 and not tr.step_fn.ahead and not tr.step_fn.early   # the first step used it
    # one backend compile of the step (the tests' persistent cache may answer it: then timing.json counts it 0)
    backend = [a for name, a, b, is_backend in compile_watch().named if name == "step" and is_backend and a >= t0]
    assert len(backend) == 1, backend
    t = json.loads((run_dir(cfg) / "timing.json").read_text())
    assert "step" in t["programs"] and "eval_step" not in t["programs"], t["programs"]   # before the first step
    assert any("eval" in k for k in t["later_programs"]), t["later_programs"]


def test_the_held_out_check_runs_the_sampler_compiled_while_training(tmp_path):
    """issue 47 item 3: after its first step SFT compiles the eval step and the held-out check's sampler on threads;
    the check runs that program on the final weights in memory and writes what `maxpost eval` of the saved
    checkpoint writes, completion for completion."""
    from maxpost.commands import start_trainer
    from maxpost.sft import SFTTrainer, held_out_after_sft, _held_out_config
    from maxpost.eval_command import run_evaluation
    cfg = load_config("sft", [f"base_output_directory={tmp_path}", "run_name=h", "steps=3", "eval_num_prompts=8", *SMALL])
    tr = start_trainer(SFTTrainer, cfg)
    tr.fit(progress=False)
    assert tr.held_out is not None and len(tr.eval_fn.programs) == 1 and not tr.eval_fn.ahead
    in_memory = held_out_after_sft(cfg, tr)
    assert len(tr.held_out.fn.programs) == 1 and not tr.held_out.fn.ahead   # the program compiled while training
    record = lambda: json.loads(next(tmp_path.glob("eval-*/eval.json")).read_text())
    mem = record()
    from_disk = run_evaluation(_held_out_config(cfg))                      # `maxpost eval`'s path: read back
    disk = record()
    assert in_memory == from_disk and mem["metrics"] == disk["metrics"]
    assert [c["completion"] for c in mem["completions"]] == [c["completion"] for c in disk["completions"]]
