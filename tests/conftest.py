"""Every test process sees 8 virtual CPU devices, so sharding code runs for real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The 8 devices are threads of one process. When the 2-core host is overloaded, one of them can reach a collective
# more than a minute after the others, and XLA's CPU runtime then aborts the process (default: 40 s after the
# 20 s "may be stuck" warning); the longer limit keeps an overloaded run slow instead of killed.
_flags = ["--xla_force_host_platform_device_count=8", "--xla_cpu_collective_call_terminate_timeout_seconds=900",
          "--xla_cpu_collective_call_warn_stuck_timeout_seconds=120"]
for _flag in _flags:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test processes (pytest workers, the CLI and notebook subprocesses they start) compile the same small programs
# again and again; JAX's persistent compilation cache lets a later process reuse an earlier one's executable.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxpost-tests-jax-cache"))
# Tokenized datasets (maxpost.data) and datasets' arrow copies of local files are cached per user, under keys that
# follow the files' paths; the tests' files live in fresh temporary directories, so those caches only grew (21 GB of
# arrow copies in the home directory of a host that ran the suite a few times in a day, until its disk was full). One
# pair of directories serves a whole session (the pytest workers and the commands they start inherit them) and is
# removed when the process that made it exits.
if "MAXPOST_CACHE_DIR" not in os.environ:
    import atexit, shutil, tempfile
    _session_cache = tempfile.mkdtemp(prefix="maxpost-tests-cache-")
    atexit.register(shutil.rmtree, _session_cache, True)
    os.environ["MAXPOST_CACHE_DIR"] = _session_cache
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_session_cache, "datasets"))

# The kinds of run register themselves when their modules are imported (chapter 00_config): import them all, as the
# `maxpost` command does, so that `load_config("sft", ...)` finds its kind in every test.
from maxpost.cli import load_kinds  # noqa: E402
load_kinds()   # every kind registered, as the `maxpost` command has them

# The commands and notebooks the tests start (subprocesses) share that persistent cache; the pytest workers themselves
# do not use it. Inside a worker, reading an executable back from it (XLA's CPU client's `deserialize_executable`, on
# a `compile_ahead` thread) segfaulted the worker three times (stop 57; twice on 2026-12-07, the last in test_sft's
# compile-ahead test, one read at a time), and pytest-xdist then waited for the dead worker's tests until CI's time
# limit. Without the cache a worker compiles what it runs; nothing in a worker's own tests counts on a cache hit.
import jax  # noqa: E402
jax.config.update("jax_enable_compilation_cache", False)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _compiles_settled():
    """After each test, wait for the compiles it started ahead and never took (a trainer's evaluation, an update it did not
    reach): the next test in the worker then never traces or compiles beside them. Twice a worker died with two such
    leftover threads inside XLA's CPU client (`maxpost.compile.settle_compiles`)."""
    yield
    from maxpost.compile import settle_compiles
    settle_compiles()
