"""Two local processes x 4 CPU devices joined by jax.distributed give the single-process forward and gradients."""
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"


def _load_worker():
    spec = importlib.util.spec_from_file_location("multihost_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(port: int, pid: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f)
    if flags: env["XLA_FLAGS"] = flags
    env.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(pid), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out)], env=_worker_env(port, i), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs, deadline = [], time.monotonic() + 300  # generous for a loaded 2-core CI box; never hangs
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs: p.kill()
        pytest.fail("multi-process workers timed out:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed (rc={p.returncode}):\n{log[-5000:]}"
    return [dict(np.load(out / f"process{i}.npz")) for i in range(2)]


def test_processes_see_all_devices(two_process_run):
    for r in two_process_run:
        assert int(r["info/process_count"]) == 2
        assert int(r["info/device_count"]) == 8
        assert int(r["info/local_device_count"]) == 4


@pytest.mark.parametrize("mesh_name", list(_load_worker().MESHES))
def test_two_processes_equal_single_process(two_process_run, mesh_name):
    w = _load_worker()
    with jax.default_device(jax.devices()[0]):
        y, loss, grads = w.step(w.MLP(rngs=nnx.Rngs(0)), jax.numpy.asarray(w.global_batch()))
    want = {"y": y, "loss": loss, **grads}
    for r in two_process_run:
        for k, v in want.items():
            np.testing.assert_allclose(r[f"{mesh_name}/{k}"], np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=k)
    rows = [tuple(r[f"{mesh_name}/rows"]) for r in two_process_run]
    assert sorted(rows) == [(0, w.B // 2), (w.B // 2, w.B)]  # each process fed its own half of the batch
