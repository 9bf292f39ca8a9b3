"""Where a ``rollout=turn_batch`` GRPO step's time goes: play, and the scorer's forward + backward per micro-batch.

    PYTHONPATH=. python3 bench/turn_batch_step.py [--mazes 32] [--samples 8] [--micro 256]

Loads the committed warm start with the experiment's LoRA, plays one step's episodes, then times one
micro-batch's forward + backward in float32, with TF32 matmuls, and under bfloat16 autocast, and prints
the profiler's top CUDA ops of the float32 pass.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import compose_config  # noqa: E402

from rlexp.config import validate  # noqa: E402
from rlexp.envs import load_pinned  # noqa: E402
from rlexp.models import load_policy  # noqa: E402
from rlexp.rollout.turn_batch import TurnBatchEngine  # noqa: E402
from rlexp.training.update import Sample  # noqa: E402


def timed(fn, device):
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return out, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mazes", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--micro", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cluster = "cluster=gpu_1x" if args.device.startswith("cuda") else "cluster=local_cpu"
    cfg = compose_config("experiment=tiny_maze_repro", "rollout=turn_batch", cluster, f"cluster.device={args.device}",
                         "model.path=checkpoints/maze_sft_warm_seed0")
    validate(cfg)
    device = torch.device(args.device)
    model, processor = load_policy(cfg.model, args.device)
    engine = TurnBatchEngine(model, processor)
    mazes = load_pinned("maze_easy")[: args.mazes]
    engine.play(mazes[:2], cfg.env, 2, 1.0, 20)  # warm-up
    played, t_play = timed(lambda: engine.play(mazes, cfg.env, args.samples, 1.0, 20), device)
    print(f"play {len(mazes)} x {args.samples}: {t_play:.2f} s, {played.num_turns} turns, "
          f"{played.num_turns / t_play:.0f} turns/s, success {float(played.success.float().mean()):.3f}")
    samples = [Sample(seq, 1.0, group=e // args.samples, trajectory=e) for seq, e in played.sequences()]
    batch = engine.scorer.batch(samples[: args.micro], device)

    def step():
        logp, _ = engine.scorer.logprobs(batch, 1.0)
        logp.sum().backward()

    for name, tf32, autocast in (("float32", False, False), ("tf32", True, False), ("bf16 autocast", False, True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            step()
            _, t = timed(step, device)
            with torch.no_grad():
                _, t_fwd = timed(lambda: engine.scorer.logprobs(batch, 1.0), device)
        print(f"micro-batch of {len(samples[: args.micro])} ({name}): forward+backward {t * 1e3:.0f} ms, forward {t_fwd * 1e3:.0f} ms")
    torch.backends.cuda.matmul.allow_tf32 = False
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15))


if __name__ == "__main__":
    main()
