"""Asynchronous checkpoints (issue 41): the loop goes on while a save is written; one save at a time; a failure in
the background is still one line and exit 5, found at the next save or at exit; a kill during a write resumes from
the newest complete checkpoint; the values written are those at the save although the next step donates them."""
import os, signal, subprocess, sys, time
from pathlib import Path

import jax, jax.numpy as jnp, numpy as np, pytest
from flax import nnx

from maxpost.checkpoint import CheckpointError, checkpoint_manager, finish_saves, restore_state, save_state
from maxpost.model import create_model, get_model_config
from maxpost.rundir import read_metrics
from maxpost.sharding import make_mesh

ROOT = Path(__file__).resolve().parent.parent
ENV1 = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")


def test_an_async_save_writes_the_values_at_the_save_while_a_donating_step_runs():
    """8 devices, fsdp x tensor: the save returns with the write in flight, then a step that donates the state
    (as the train step does) runs and changes every array; the checkpoint holds the values at the save. On a CPU
    the host copy Orbax writes from is the device buffer itself, so a reused buffer would corrupt the write."""
    import optax, tempfile
    mesh = make_mesh(fsdp=4, tensor=2)
    params = nnx.state(create_model(get_model_config("tiny"), seed=3, mesh=mesh), nnx.Param)
    opt = optax.adamw(1e-3).init(params)
    noise = lambda t, k: jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(k), x.shape, x.dtype)
                                      if x.dtype == jnp.float32 else x, t)
    params, opt = noise(params, 1), noise(opt, 2)
    at_save = [np.array(x) for x in jax.tree.leaves((params, opt))]
    d = Path(tempfile.mkdtemp()) / "c"
    mgr = checkpoint_manager(d, async_save=True)
    save_state(mgr, 1, params, opt, meta={"data": 7})
    assert mgr.maxpost_pending == 1
    step = jax.jit(lambda p, o: jax.tree.map(lambda x: x * 3 + 1 if x.dtype == jnp.float32 else x, (p, o)),
                   donate_argnums=(0, 1))
    for _ in range(3): params, opt = step(params, opt)
    after = [np.array(x) for x in jax.tree.leaves((params, opt))]
    finish_saves(mgr)
    like = jax.tree.map(jnp.zeros_like, (params, opt))
    p, o, meta = restore_state(checkpoint_manager(d), *like)
    assert meta == {"data": 7, "step": 1}
    for a, b, c in zip(at_save, jax.tree.leaves((p, o)), after):
        np.testing.assert_array_equal(np.asarray(b), a)
        assert a.size <= 1 or not np.array_equal(a, c)          # the step did change what was saved
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)): assert a.sharding == b.sharding


RANDOM_STATE = """
import jax, jax.numpy as jnp, optax
from flax import nnx
from maxpost.model import create_model, get_model_config
def _random_state(seed=0):
    params = nnx.state(create_model(get_model_config("tiny"), seed=seed), nnx.Param)
    noise = lambda x: x + jax.random.normal(jax.random.key(seed + 1), x.shape, x.dtype) if x.dtype == jnp.float32 else x
    return params, jax.tree.map(noise, optax.adamw(1e-3).init(params))
"""


def _failing_write(tmp_path, then: str):
    """A child that saves step 1 asynchronously (complete), then step 2 under a 1 MB file-size limit (fails in
    Orbax's threads after save_state returned), then `then`; a CheckpointError is printed as the CLI prints it."""
    code = RANDOM_STATE + f"""
import resource, signal, sys
from maxpost.checkpoint import checkpoint_manager, save_state, finish_saves, save_limit_gb, CheckpointError
params, opt = _random_state()
mgr = checkpoint_manager({str(tmp_path / "ck")!r}, max_to_keep=2, save_concurrent_gb=save_limit_gb(params, opt),
                         async_save=True)
save_state(mgr, 1, params, opt); finish_saves(mgr)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (10**6, resource.RLIM_INFINITY))
try:
    save_state(mgr, 2, params, opt)
    print("save_state returned", flush=True)
    {then}
except CheckpointError as e: print("CheckpointError:", e, file=sys.stderr); sys.exit(5)
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("then, found", [("save_state(mgr, 3, params, opt)", "found at the save of step 3"),
                                         ("finish_saves(mgr, ' (found at exit)')", "found at exit")])
def test_a_write_that_fails_in_the_background_is_one_line_at_the_next_save_or_at_exit(tmp_path, then, found):
    """issue 32's one-line error, now from Orbax's threads: save_state returns, the failure is found at the next
    save or at exit, and stderr holds only the CheckpointError naming the failed step, where it was found and the
    intact step (no Orbax traceback, no "Event loop is closed", no "coroutine was never awaited"); step 1 restores."""
    r = _failing_write(tmp_path, then)
    assert r.returncode == 5, r.stderr[-3000:]
    assert "save_state returned" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("CheckpointError: could not write checkpoint step 2"), r.stderr[-3000:]
    assert found in lines[0] and "(step 1) is intact" in lines[0]
    exec(RANDOM_STATE, g := {})
    params, opt = g["_random_state"]()
    back, _, meta = restore_state(checkpoint_manager(tmp_path / "ck"), params, opt)
    assert meta["step"] == 1
    for a, b in zip(jax.tree.leaves((params, opt)), jax.tree.leaves(back)): np.testing.assert_array_equal(a, b)


def test_a_background_failure_to_make_the_step_directory_does_not_hang_the_exit(tmp_path):
    """issue 21, item 8, asynchronously: when Orbax's thread cannot make the step's temporary directory, its other
    threads wait for a "directory made" signal that never comes, and interpreter shutdown joined them for Orbax's
    20-minute timeout. Now the error is found at exit, the waiting threads are released, and the process ends."""
    code = f"""
import os, sys
import jax.numpy as jnp
from maxpost.checkpoint import checkpoint_manager, save_state, finish_saves, CheckpointError
d = {str(tmp_path / "ck")!r}
mgr = checkpoint_manager(d, async_save=True)
save_state(mgr, 1, {{"w": jnp.ones((64, 64))}}); finish_saves(mgr)
real_mkdir = os.mkdir
def refuse(p, *a, **k):   # only the step's directory: made by Orbax's thread, after save_state returned
    if "orbax-checkpoint-tmp" in str(p): raise PermissionError(13, "Permission denied", str(p))
    return real_mkdir(p, *a, **k)
os.mkdir = refuse
save_state(mgr, 2, {{"w": jnp.zeros((64, 64))}})
try: finish_saves(mgr, " (found at exit)")
except CheckpointError as e: print("CheckpointError:", e, file=sys.stderr); sys.exit(5)
"""
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV1, timeout=300)
    assert r.returncode == 5, r.stderr[-3000:]
    assert time.time() - t < 120, "the process waited on Orbax's threads"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "step 2" in lines[0] and "Permission denied" in lines[0], r.stderr[-3000:]
    assert "(step 1) is intact" in lines[0]


# ---- the CLI: killed during a write, and a write that fails in the background

SMALL = ["model_name=tiny", "train_split=train[:256]", "eval_split=test[:16]", "global_batch_size=8",
         "max_target_length=96", "log_period=1", "eval_batches=1", "warmup_steps=2", "learning_rate=3e-3"]

# `maxpost` with Orbax's array writes hooked (Orbax's own tests hook the same function): `slow` delays each, so that a
# write takes seconds and a kill lands inside one whatever the load of the machine; `limit` lets no file pass 1 MB
# from the first array write on (a quota, a disk filled by another process), so that the checkpoint fails in flight
HOOKED = """
import resource, signal, sys, time
from orbax.checkpoint._src.serialization import serialization as S
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # past the limit a write fails with EFBIG instead of killing the process
_write, hook = S.async_serialize_from_host, sys.argv.pop(1)
def hooked(*a, **k):
    if hook == "slow": time.sleep(0.1)
    if hook == "limit": resource.setrlimit(resource.RLIMIT_FSIZE, (10**6, resource.RLIM_INFINITY))
    return _write(*a, **k)
S.async_serialize_from_host = hooked
from maxpost.cli import main
sys.exit(main())
"""


def sft(base, run, steps, *extra, hook=None):
    head = [sys.executable, "-c", HOOKED, hook] if hook else [sys.executable, "-m", "maxpost.cli"]
    return [*head, "sft", f"base_output_directory={base}", f"run_name={run}", f"steps={steps}", *SMALL, *extra]


def test_a_run_killed_during_a_checkpoint_write_resumes_from_the_newest_complete_one(tmp_path):
    """kill -9 while step 8 is being written (its `8.orbax-checkpoint-tmp` exists, `8` does not): the rerun resumes
    from step 4, writes step 8 again in place of the leftover, and ends with the weights and the metrics of an
    uninterrupted run."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    steps, extra = 12, ["checkpoint_period=4", "max_checkpoints_to_keep=3"]
    r = subprocess.run(sft(tmp_path, "whole", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    p = subprocess.Popen(sft(tmp_path, "killed", steps, *extra, hook="slow"), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    ck = tmp_path / "killed" / "checkpoints"
    tmp8 = ck / "8.orbax-checkpoint-tmp"
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None and not tmp8.exists(): time.sleep(0.005)
    time.sleep(0.3)                                   # into the write: arrays under way
    p.send_signal(signal.SIGKILL); p.wait()
    names = sorted(x.name for x in ck.iterdir())
    assert "8.orbax-checkpoint-tmp" in names and "8" not in names and "4" in names, names
    r = subprocess.run(sft(tmp_path, "killed", steps, *extra), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(x.name for x in ck.iterdir()) == ["12", "4", "8"]      # the leftover replaced by the new step 8
    like = nnx.state(create_model(get_model_config("tiny")), nnx.Param)
    a, _, ma = restore_state(checkpoint_manager(tmp_path / "whole" / "checkpoints"), like)
    b, _, mb = restore_state(checkpoint_manager(ck), like)
    assert ma["step"] == mb["step"] == steps
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)): np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [m["step"] for m in read_metrics(tmp_path / "killed", "train")] == list(range(1, steps + 1))


def test_a_run_whose_checkpoint_fails_in_the_background_exits_5_with_one_line(tmp_path):
    """`maxpost sft` whose first checkpoint write meets a file-size limit: the write of step 2 fails in Orbax's
    threads; the run says so in one line naming step 2, where it was found, and that no step is intact, and exits 5
    (no traceback, no "Event loop is closed"); nothing but complete steps on disk."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run(sft(tmp_path, "r", 4, "checkpoint_period=2", hook="limit"), env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 5, r.stderr[-3000:]
    line = [l for l in r.stderr.splitlines() if l.startswith("maxpost sft:")]
    assert len(line) == 1 and "could not write checkpoint step 2" in line[0], r.stderr[-3000:]
    assert "written in the background; found at the save of step 4" in line[0]
    assert "No checkpoint had been written before it" in line[0]
    assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]
    assert not [x for x in (tmp_path / "r" / "checkpoints").iterdir() if x.name.isdigit()]
