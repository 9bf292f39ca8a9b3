#!/usr/bin/env bash
# The H200 work of issues 9, 10 and 14 as one queue that outlives a device call, for one warm lease:
#
#   bash bench/h200_queue.sh start [STEP…]   # after vLLM's install (shared/tools/vllm-offline), in the same call;
#                                            # STEP: contract vllmbench explore plan update grpo (default: all but grpo)
#   bash bench/h200_queue.sh wait 540 [PAT]  # each later call, back to back: wait up to 540 s (or until PAT shows
#                                            # in the progress log), then copy the logs and figures to $OUT
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
    # issue 8: GRPO from the warm start with rollout=turn_batch, two training seeds side by side on the one GPU
    step grpo bash -c 'for s in 0 1; do OMP_NUM_THREADS=6 python3 -m rlexp experiment=tiny_maze_repro rollout=turn_batch \
        logger=none cluster.gpu_memory_gb=70 cluster.cpu_memory_gb=32 total_steps=${GRPO_STEPS:-300} seed=$s \
        run_name=turn_batch_seed$s > '"$QUEUE"'/grpo_seed$s.log 2>&1 & done; wait'
    echo done >> "$QUEUE/progress"
    ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ] && ! grep -q "${3:-^done}" "$QUEUE/progress" 2>/dev/null; do sleep 5; done
    cat "$QUEUE/progress"
    for f in "$QUEUE"/*.log "$QUEUE"/*.json "$QUEUE/gpu.txt"; do [ -f "$f" ] && cp "$f" "${OUT:?}/"; done
    if [ -d outputs/tiny_maze_repro ]; then  # the GRPO runs' metrics, evals and checkpoints (LoRA adapters, a few MB)
      (cd outputs/tiny_maze_repro && find . -name metrics.jsonl -o -path '*/eval/*' -o -path '*/policy/*' \
        | grep -v '/checkpoints/.*/policy/' | tar czf "$OUT/grpo_runs.tgz" -T -)
      for r in outputs/tiny_maze_repro/*/checkpoints; do  # the newest checkpoint's adapter of each run
        last=$(ls -d "$r"/global_step_* 2>/dev/null | sort -V | tail -1)
        [ -n "$last" ] && tar czf "$OUT/$(basename "$(dirname "$r")")_latest.tgz" -C "$(dirname "$r")" "checkpoints/$(basename "$last")/policy"
      done
    fi
    for f in "$QUEUE"/*.log; do echo "== $f"; tail -c 2500 "$f" | tr '\r' '\n' | tail -n 8; done
    ;;
  *) echo "usage: $0 start [STEP...] | wait SECONDS [PATTERN]" >&2; exit 2 ;;
esac
