"""Every test process sees 8 virtual CPU devices, so sharding code runs for real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test processes (pytest workers, the CLI and notebook subprocesses they start) compile the same small programs
# again and again; JAX's persistent compilation cache lets a later process reuse an earlier one's executable.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxpost-tests-jax-cache"))
