"""What the distributed tests run inside each rank (importable by the spawned rank processes, which get
this directory on ``PYTHONPATH``), and a driver for whole runs in a subprocess."""

import os
import sys
from pathlib import Path

import torch

from conftest import compose_config
from rlexp.envs import ExpertPolicy
from rlexp.rollout.conversation import training_sequences
from rlexp.rollout.driver import scripted_trajectories
from rlexp.tasks.train_grpo import GRPOStep
from rlexp.tasks.train_sft import SFTStep
from rlexp.tracking import Trackers
from rlexp.training import distributed
from rlexp.training.loop import TrainingRun, run_training, turn_limit
from rlexp.training.update import Sample

#: a GRPO update with two optimizer steps (mini-batches of 2 mazes) and more than one micro-batch.
UPDATE = (
    "name=dist", "algorithm.train_batch_size=4", "algorithm.policy_mini_batch_size=2", "algorithm.n_samples_per_prompt=3",
    "algorithm.micro_batch_size=2", "algorithm.lr=0.01", "rollout.max_turns=4", "rollout.max_new_tokens_per_turn=6",
    "eval.num_mazes=2",
)
#: a whole run of a few steps: evals of 2 mazes at 2 turns, a checkpoint every step.
RUN = (
    "name=dist", "algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=2", "algorithm.n_samples_per_prompt=2",
    "algorithm.micro_batch_size=2", "algorithm.lr=0.01", "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=6",
    "eval.num_mazes=2", "eval_interval=100", "ckpt_interval=1", "logger=none",
)


def one_update(run_dir: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One GRPO update on fixed data (the BFS expert's episodes, advantages a fixed function of each episode):
    the step's metrics and the updated adapter, consolidated. In one process, or as one of several ranks."""
    if "RANK" in os.environ:
        distributed.init_process_group("cpu")
    run = TrainingRun(compose_config(*UPDATE), Path(run_dir), Trackers([]))
    cfg = run.cfg
    group = cfg.algorithm.n_samples_per_prompt
    trajectories = scripted_trajectories(ExpertPolicy(), run.mazes(), cfg.env, group, turn_limit(cfg), run.formatter)
    samples = [
        Sample(sequence, 0.5 + t.sample_index - 0.1 * len(t.turns), group=t.maze_index, trajectory=i)
        for i, t in enumerate(trajectories)
        for sequence in training_sequences(run.formatter, t, cfg.env.history_window)
    ]
    step = GRPOStep(run)
    run.update.score(samples, cfg.rollout.temperature, reference=False)
    metrics = run.update.run(samples, step.loss, cfg.rollout.temperature)
    adapter = distributed.adapter_state(run.model)
    distributed.destroy_process_group()
    return metrics, adapter


def train(run_name: str, processes: int, algorithm: str, *overrides: str) -> float:
    """A whole run in ``outputs/dist/<run_name>`` under the working dir, in ``processes`` ranks."""
    cfg = compose_config(*RUN, f"algorithm={algorithm}", f"run_name={run_name}", *overrides)
    return run_training(cfg, SFTStep if algorithm == "sft" else GRPOStep, processes=processes)


if __name__ == "__main__":  # python distributed_support.py RUN_NAME PROCESSES ALGORITHM [overrides…]
    train(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
