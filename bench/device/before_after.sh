#!/usr/bin/env bash
# Before/after on a lent accelerator, interleaved, in one device call (bench/device/README.md, eighth session). The
# checkout is "before"; the change's tree is unpacked beside it first (untracked, not ignored, so that it travels):
#   mkdir -p bench/device/after_tree && git -C <change's worktree> archive HEAD | tar x -C bench/device/after_tree
#   RUNS="dec_a dec_b sft_a1 sft_b1 prof rl_a" OUT=/tmp/out bash bench/device/before_after.sh
# dec_a / dec_b: probe_init_decode.py's 1B decode; sft_aN / sft_bN: e2e.py part b (the 1B SFT, an empty compile and
# data cache each); rl_a: part c (the 1B RL) of the change; prof: profile_step.py's 1B decode profile of the change,
# its optimized HLO kept. Delete after_tree afterwards.
set -u
T=bench/device/after_tree
PROBE=1 PROBE_PARTS=none bash bench/device/tpu_run.sh > $OUT/install_run.txt 2>&1; tail -3 $OUT/install_run.txt
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
dec() { (cd $1 && timeout 100 python3 bench/device/probe_init_decode.py decode base) > $OUT/decode_$2.log 2>&1; echo "decode $2: $(grep 'ms a step\|first call' $OUT/decode_$2.log | tr '\n' ' ')"; }
sft() { rm -rf /tmp/mc; mkdir -p /tmp/mc $OUT/$2; (cd $1 && MAXPOST_CACHE_DIR=/tmp/mc OUT=$OUT/$2 timeout 130 python3 bench/e2e.py --param-dtype bfloat16 --box-scale 1.0 --parts b) > $OUT/$2.log 2>&1
  echo "sft $2: $(grep -o '"first_step_s": [0-9.]*\|"first/[a-z_]*": [0-9.]*' $OUT/$2.log | tr '\n' ' ')"; grep -h "compile  \|steady step\|device  " $OUT/$2/b-sft.log; }
prof() { (cd $T && timeout 200 python3 bench/profile_step.py rollout --platform "" --preset llama3.2-1b --batch 64 --prompt 64 --new 256 --dtype bfloat16 --top 45 --save-hlo $OUT/rollout_hlo.txt.gz) > $OUT/prof.log 2>&1; grep -v Warn $OUT/prof.log | head -12; }
rl() { rm -rf /tmp/mc; mkdir -p /tmp/mc $OUT/$2; (cd $1 && MAXPOST_CACHE_DIR=/tmp/mc OUT=$OUT/$2 timeout 200 python3 bench/e2e.py --param-dtype bfloat16 --box-scale 1.0 --parts c) > $OUT/$2.log 2>&1
  echo "rl $2: $(grep -o '"first_step_s": [0-9.]*\|"wall_s": [0-9.]*\|"steps_done": [0-9]*\|"returncode": [0-9-]*' $OUT/$2.log | tr '\n' ' ')"; grep -h "compile  \|steady step\|time to first\|device  \|pass@1" $OUT/$2/c-rl.log | head -12; }
for x in $RUNS; do case $x in prof) prof;; rl_a) rl $T rl_a;; dec_a) dec $T after;; dec_b) dec . before;; sft_a*) sft $T $x;; sft_b*) sft . $x;; esac; done
cd $OUT && tar czf runs.tgz $(ls -d sft_*/ rl_*/ 2>/dev/null) && rm -rf sft_*/ rl_*/
