#!/usr/bin/env bash
# Interleaved rounds of one short `maxpost sft` in two source trees, A and B (the first-step table's parts from each
# run's timing.json, and the command's wall time): how a change to a command's start (imports, backend) moves it.
#   A=/tmp/before B=$PWD ROUNDS=3 OUT=/tmp/out bash bench/device/ab_start.sh
# A warm-up run in A first fills JAX's compilation cache (MAXPOST_CACHE_DIR, shared by every run here), so each
# timed run loads its programs and the rounds differ in what happens before the first step, not in compiling.
set -u
OUT=${OUT:-/tmp/ab_out}; R=${R:-/tmp/ab_runs}; PY=${PY:-python3}; mkdir -p "$OUT"
ARGS="steps=2 log_period=1 eval_interval=0 eval_num_prompts=0 checkpoint_period=100000 base_output_directory=$R"
one() { local label=$1 tree=$2 name=$3 t=$(date +%s%N)
  (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} $PY -m maxpost.cli sft run_name=$name $ARGS) > "$OUT/$name.log" 2>&1
  local rc=$? wall=$(( ($(date +%s%N) - t) / 1000000 ))
  $PY -c "import json,sys; f=json.load(open('$R/$name/timing.json'))['first_step']; print('$label', 'rc $rc', 'wall %.2f' % ($wall / 1000), ' '.join(f'{k} {v:.2f}' for k, v in f.items() if isinstance(v, (int, float))))" 2>/dev/null \
    || echo "$label rc $rc wall ${wall} ms (no timing.json)"; }
one A "$A" warm > /dev/null
for i in $(seq ${ROUNDS:-3}); do one A "$A" a$i; one B "$B" b$i; done
