"""JAX's persistent compilation cache (issue 41): after `enable_compilation_cache`, a second process running the same
programs compiles none of them, small and quick ones included (JAX's default keeps only those over a second)."""
import json, os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Two programs: a small elementwise one (compiles in milliseconds) and the tiny model's forward pass. JAX's own
# monitoring events count the compilations asked for (each one looked up in the persistent cache when there is one)
# and those the cache answered.
CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
if sys.argv[1] != "off":
    from maxpost.sharding import enable_compilation_cache
    enable_compilation_cache(sys.argv[2])
from maxpost.model import create_model, get_model_config
model = create_model(get_model_config("tiny"), seed=0)
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) * 3 + 1)(np.ones(7, np.float32)))
jax.block_until_ready(jax.jit(lambda m, t: m(t))(model, np.ones((2, 16), np.int32)))
asked = events.count("/jax/compilation_cache/compile_requests_use_cache")
print(json.dumps({"asked": asked, "answered": events.count("/jax/compilation_cache/cache_hits")}))
"""


def _run(mode, cache):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}   # the tests' own cache off
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(cache)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "jax"
    first = _run("on", cache)
    assert first["asked"] >= 3 and first["answered"] == 0, first       # every program compiled, and written
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) >= first["asked"], entries                    # the millisecond ones too
    second = _run("on", cache)
    assert second == {"asked": first["asked"], "answered": first["asked"]}, second   # compiled nothing
    assert sorted(p.name for p in cache.iterdir()) == entries
    assert _run("off", cache) == {"asked": first["asked"], "answered": 0}   # without it: every program compiled again
