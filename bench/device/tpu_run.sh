#!/usr/bin/env bash
# One call on a lent TPU (or any accelerator host whose JAX is installed and whose package index holds the rest):
# install what maxpost needs beside the host's JAX, then run the README's main job, bench/accelerator.py and the CLI
# at a real shape, each part time-boxed, logs under $OUT. Run from the repository root:
#   OUT=/tmp/out bash bench/device/tpu_run.sh            # QUICK=1: tiny shapes (a CPU rehearsal, nothing installed)
#   E2E=1 OUT=/tmp/out bash bench/device/tpu_run.sh      # bench/e2e.py instead (E2E_ARGS: its options)
#   PROBE=1 OUT=/tmp/out bash bench/device/tpu_run.sh    # compile phases per program, then the 1B SFT step's profile
#                                                          (PROBE_PARTS="profile_step": the profile alone;
#                                                          "profile_rollout": the 1B decode's, 64 rows of 64 + 256 tokens;
#                                                          "cache_layout": the decode's KV-cache layouts, probe_cache_layout.py,
#                                                          CACHE_ARGS: its options)
#   DUMP=1 OUT=/tmp/out bash bench/device/tpu_run.sh     # the 1B RL update compiled with XLA's dump: where its memory goes
# A second invocation in the same call skips the install (/tmp/site already holds it).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/tpu_out}; mkdir -p "$OUT"; R=${R:-/tmp/runs}; PY=${PY:-python3}
part() { local name=$1 box=$2; shift 2; local t=$(date +%s)
  timeout "$box" "$@" > "$OUT/$name.log" 2>&1; echo "== $name exit $? after $(( $(date +%s) - t )) s (box $box s)"
  grep -v "^\s*$" "$OUT/$name.log" | tail -${TAIL:-8}; }
if [ -z "${QUICK:-}" ] && [ ! -d /tmp/site/flax ]; then
  t=$(date +%s)
  # carried as wheels (.whl-tpu, see bench/README.md): what the host's index lacks or holds in a version that does not fit
  [ -d .whl-tpu ] && PIP_CONFIG_FILE=/dev/null $PY -m pip install --isolated -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl-tpu/*.whl > "$OUT/install.log" 2>&1
  PIP_CONFIG_FILE=/dev/null $PY -m pip install --isolated -q --only-binary=:all: --no-compile --index-url file:///opt/pypi/simple \
    --target /tmp/site ${PKGS:-flax==0.12.8 optax orbax-checkpoint datasets safetensors tokenizers transformers jinja2 tqdm pyyaml cloudpickle} \
    >> "$OUT/install.log" 2>&1; echo "== install exit $? after $(( $(date +%s) - t )) s"; grep -v notice "$OUT/install.log" | tail -3
fi
[ -z "${QUICK:-}" ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import jax, flax, optax, orbax.checkpoint, transformers; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'transformers', transformers.__version__, jax.devices())" 2>&1 | tail -2
T0=$(date +%s)
if [ -n "${PROBE:-}" ]; then  # where compile time goes (bench/compile_probe.py), then the 1B step op by op (profile_step.py)
  if [ -z "${QUICK:-}" ]; then BIG="--preset ${M:-llama3.2-1b}"; SHAPE="--preset ${M:-llama3.2-1b} --seq 1024 --batch 8"
  else BIG=""; SHAPE="--shape tiny --seq 128"; fi
  case " ${PROBE_PARTS:-compile_probe profile_step} " in *" compile_probe "*)
    part compile_probe ${T_PROBE:-240} $PY bench/compile_probe.py --parts $BIG;; esac
  case " ${PROBE_PARTS:-compile_probe profile_step} " in *" profile_step "*)
    TAIL=40 part profile_step ${T_PROF:-300} $PY bench/profile_step.py sft --platform "" $SHAPE --remat full --dtype bfloat16;; esac
  case " ${PROBE_PARTS:-compile_probe profile_step} " in *" profile_rollout "*)   # the 1B decode op by op (not by default)
    if [ -z "${QUICK:-}" ]; then ROLL="--preset ${M:-llama3.2-1b} --batch 64 --prompt 64 --new 256"
    else ROLL="--shape tiny --batch 8 --prompt 16 --new 32"; fi
    TAIL=50 part profile_rollout ${T_ROLL:-300} $PY bench/profile_step.py rollout --platform "" $ROLL --dtype bfloat16 \
      --top 45 --save-hlo "$OUT/rollout_hlo.txt.gz";; esac
  case " ${PROBE_PARTS:-compile_probe profile_step} " in *" cache_layout "*)   # the decode's cache layouts (not by default)
    TAIL=12 part cache_layout ${T_CACHE:-150} $PY bench/device/probe_cache_layout.py ${QUICK:+--quick} ${CACHE_ARGS:-};; esac
  echo "total $(( $(date +%s) - T0 )) s"; exit
fi
if [ -n "${DUMP:-}" ]; then   # XLA's own account of the 1B RL update's memory (e2e.py part c's shape, no micro-batches)
  if [ -z "${QUICK:-}" ]; then M1="model_name=${M:-llama3.2-1b} param_dtype=bfloat16"; SH="global_batch_size=64 mini_batch_size=32 max_completion_length=256"
  else M1="model_name=tiny param_dtype=float32"; SH="global_batch_size=16 mini_batch_size=8 max_completion_length=64"; fi
  rm -rf /tmp/xla_dump; XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/xla_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
    part rl_dump ${T_DUMP:-240} $PY -m maxpost.cli rl base_output_directory=$R run_name=dump $M1 dtype=bfloat16 load_parameters_path= \
    $SH num_generations=8 max_prompt_length=64 steps=1 eval_num_prompts=0
  ls -S /tmp/xla_dump | head -20
  tar czf "$OUT/xla_dump_memory.tgz" -C /tmp/xla_dump $(cd /tmp/xla_dump && ls | grep -E "memory-usage|buffer-assignment" ) 2>/dev/null
  echo "total $(( $(date +%s) - T0 )) s"; exit
fi
if [ -n "${E2E:-}" ]; then   # bench/e2e.py: the main job, then SFT, RL and DPO at a 1B preset, with where the time goes
  $PY bench/e2e.py ${E2E_ARGS:---param-dtype bfloat16 --box-scale 0.95} ${QUICK:+--quick}; echo "total $(( $(date +%s) - T0 )) s"; exit
fi
Q=${QUICK:+steps=20}
part main_sft ${T_SFT:-150} $PY -m maxpost.cli sft base_output_directory=$R $Q
part main_rl ${T_RL:-150} $PY -m maxpost.cli rl base_output_directory=$R ${QUICK:+steps=2 eval_num_prompts=8}
if [ -z "${QUICK:-}" ]; then A="--preset ${M:-qwen3-0.6b} --batches 16 64 --reps 2 --hbm-tbs 0.82"; else A="--quick"; fi
part accelerator ${T_ACC:-170} $PY bench/accelerator.py $A
part sft_real ${T_REAL:-130} $PY -m maxpost.cli sft run_name=real-shape base_output_directory=$R model_name=${M:-qwen3-0.6b} \
  ${QUICK:+model_name=tiny} dtype=bfloat16 steps=${S4:-30} global_batch_size=8 max_target_length=${L4:-1024} learning_rate=1e-5 \
  warmup_steps=0 log_period=5 eval_interval=0 eval_num_prompts=0 checkpoint_period=100000
for d in $R/*; do [ -f $d/metrics.jsonl ] && sed "s/^/$(basename $d) /" $d/metrics.jsonl; done > "$OUT/metrics_all.txt"
cp $R/*/timing.json "$OUT/" 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
