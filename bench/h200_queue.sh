#!/usr/bin/env bash
# The H200 work of issues 9, 10 and 14 as one queue that outlives a device call, for one warm lease:
#
#   bash bench/h200_queue.sh start [STEP…]   # after vLLM's install (shared/tools/vllm-offline), in the same call;
#                                            # STEP: contract vllmbench explore plan update grpo (default: all but grpo)
#   bash bench/h200_queue.sh wait 540 [PAT]  # each later call, back to back: wait up to 540 s (or until PAT shows
#                                            # in the progress log), then copy the logs and figures to $OUT, and
#                                            # each GRPO run dir as run_<name>.tgz (its newest checkpoint whole)
#
# A GRPO run goes on in a later session: untar run_<name>.tgz into outputs/tiny_maze_repro/<name>, carry that
# path (with .whl) and `start grpo` with the same GRPO_RUN and seeds.
#
# `start` runs, in order and detached (setsid), bench/maze_exploration.py on the SFT warm start (issue 8), the engine contract suite with vLLM, bench/plan_calibration.py,
# bench/update_step.py (which builds the 8B-shaped model that vllm_rollout then reuses) and bench/vllm_rollout.py, each logging to $QUEUE (default /tmp/rlexp-h200); `progress` there says which
# step is running and each step's exit status. Needs the hydra/omegaconf/gymnasium wheels in /tmp/site and
# vLLM in /tmp/vllm-site, as the device README and vllm-offline's README say.
set -u
QUEUE=${QUEUE:-/tmp/rlexp-h200}
cd "$(dirname "$0")/.."
case "${1:-}" in
  start)
    mkdir -p "$QUEUE"
    shift
    setsid nohup bash "$0" run "$@" > "$QUEUE/queue.out" 2>&1 < /dev/null &
    ;;
  run)
    export PYTHONPATH=/tmp/vllm-site:/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    shift
    wanted=" ${*:-contract vllmbench explore plan update} "
    step() {
      local name=$1; shift
      [[ $wanted == *" $name "* ]] || return 0
      echo "$(date +%T) start $name" >> "$QUEUE/progress"
      "$@" > "$QUEUE/$name.log" 2>&1
      local rc=$?  # before $(date) below resets $?
      echo "$(date +%T) end $name rc=$rc" >> "$QUEUE/progress"
    }
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$QUEUE/gpu.txt" 2>&1
    step contract python3 -m pytest -p no:cacheprovider -rs --tb=short -q \
      tests/rollout/test_engine_contract.py tests/tasks/test_export.py tests/tasks/test_eval_engine.py
    step vllmbench python3 bench/vllm_rollout.py --out "$QUEUE"
    step explore python3 bench/maze_exploration.py --checkpoint checkpoints/maze_sft_warm_seed0 --json "$QUEUE/explore.json"
    step plan python3 bench/plan_calibration.py
    step update python3 bench/update_step.py --size 8b --out "$QUEUE"
    # issue 8: GRPO from the warm start with rollout=turn_batch: one run per seed of GRPO_SEEDS (default 0 1), side by
    # side on the one GPU, named ${GRPO_RUN:-turn_batch}_seed<s>, with GRPO_ARGS as more overrides. A run dir carried
    # in (outputs/tiny_maze_repro/<run>, as `wait` brought it back) continues from its newest checkpoint.
    step grpo bash -c 'for s in ${GRPO_SEEDS:-0 1}; do OMP_NUM_THREADS=6 python3 -m rlexp experiment=tiny_maze_repro \
        rollout=turn_batch logger=none cluster.gpu_memory_gb=70 cluster.cpu_memory_gb=32 total_steps=${GRPO_STEPS:-300} \
        seed=$s run_name=${GRPO_RUN:-turn_batch}_seed$s ${GRPO_ARGS:-} > '"$QUEUE"'/grpo_seed$s.log 2>&1 & done; wait'
    echo done >> "$QUEUE/progress"
    ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ] && ! grep -q "${3:-^done}" "$QUEUE/progress" 2>/dev/null; do sleep 5; done
    cat "$QUEUE/progress"
    for f in "$QUEUE"/*.log "$QUEUE"/*.json "$QUEUE/gpu.txt"; do [ -f "$f" ] && cp "$f" "${OUT:?}/"; done
    for run in outputs/tiny_maze_repro/*/; do  # each GRPO run dir as it can resume: all but older checkpoints
      [ -d "$run/checkpoints" ] || continue
      last=$(ls -d "$run"checkpoints/global_step_* 2>/dev/null | sort -V | tail -1)
      (cd "$run" && find . -path ./checkpoints -prune -o -type f ! -name '*.png' -print \
        | { cat; [ -n "$last" ] && echo "./checkpoints/$(basename "$last")"; } \
        | tar czf "$OUT/run_$(basename "$run").tgz" -T -)
    done
    for f in "$QUEUE"/*.log; do echo "== $f"; tail -c 2500 "$f" | tr '\r' '\n' | tail -n 8; done
    ;;
  *) echo "usage: $0 start [STEP...] | wait SECONDS [PATTERN]" >&2; exit 2 ;;
esac
