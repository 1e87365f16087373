"""Where a command's start goes on an accelerator host (bench/device/README.md, tenth session), one process per call:

    python bench/device/probe_startup.py serial    # import jax, start the backend, then import maxpost's commands
    python bench/device/probe_startup.py thread    # the same with the backend started on a thread beside the imports

Prints each part's seconds from the process's start (as `maxpost`'s first-step table counts `startup`). `thread`
says whether the accelerator's runtime starts while Python imports (the runtime's start letting go of the GIL): if
so, its `all` is about `serial`'s less the imports after jax."""
import sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def since_start() -> float:
    "Seconds since this process started (/proc/self/stat's start time, as maxpost.timing reads it)."
    import os
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(l.split()[1]) for l in open("/proc/stat") if l.startswith("btime"))
    return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))


def main(mode: str) -> None:
    t = {"python": since_start()}
    import jax
    t["import jax"] = since_start()
    th = None
    if mode == "thread":
        th = threading.Thread(target=jax.devices); th.start()
    else:
        jax.devices(); t["backend"] = since_start()
    import maxpost.cli as cli
    cli.load_kinds()
    t["import maxpost"] = since_start()
    if th is not None: th.join(); t["backend joined"] = since_start()
    jax.numpy.zeros(1).block_until_ready(); t["first array"] = since_start()
    print(mode + ": " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()) + f"; {jax.devices()[0].device_kind}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "serial")
