"""Whether a TPU's runtime can start while Python imports the rest (bench/device/README.md, seventh session):

    python bench/device/probe_startup.py serial|thread

`serial`: import jax, then maxpost's command line and every kind (what `maxpost sft` imports before it runs), then
the first device query (the runtime starts). `thread`: the first device query on a thread right after `import jax`,
the imports meanwhile. Prints when each ended, from the process start."""
import os, sys, threading, time
from pathlib import Path
T0 = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax
t_jax = time.time() - T0
done = {}
def devices(): jax.devices(); done["devices"] = time.time() - T0
th = threading.Thread(target=devices) if sys.argv[1] == "thread" else None
if th: th.start()
import maxpost.cli as cli; cli.load_kinds()
t_imports = time.time() - T0
if th: th.join()
else: devices()
print(f"{sys.argv[1]}: import jax {t_jax:.2f} s, the rest imported at {t_imports:.2f} s, devices ready at "
      f"{done['devices']:.2f} s, all at {time.time() - T0:.2f} s ({jax.devices()[0].device_kind})", flush=True)
