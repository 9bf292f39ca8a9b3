"""Recipe: supervised fine-tuning on BFS-expert trajectories generated on the fly.

The expert plays each maze in the same chat and action format as RL; the loss is the negative
log-likelihood of the assistant tokens only, at temperature 1 (the model's own distribution, not the
rollout's sampling temperature), mean over the mini-batch's tokens. There is no old-log-prob pass.
"""

import torch
from omegaconf import DictConfig

from rlexp.algorithms.grpo import sft_loss
from rlexp.envs import ExpertPolicy
from rlexp.rollout.conversation import training_sequences
from rlexp.rollout.driver import scripted_trajectories
from rlexp.training.loop import TrainingRun, run_training, timed, turn_limit
from rlexp.training.update import MicroBatch, Normalizers, Sample

#: the temperature SFT scores at: the model's own distribution.
SFT_TEMPERATURE = 1.0


def train(cfg: DictConfig) -> float:
    return run_training(cfg, SFTStep)


class SFTStep:
    def __init__(self, run: TrainingRun):
        self.run = run
        self.cfg = run.cfg

    def __call__(self) -> dict[str, float]:
        run, cfg = self.run, self.cfg
        mazes = run.mazes()
        trajectories, t_generate = timed(scripted_trajectories, ExpertPolicy(), mazes, cfg.env, 1, turn_limit(cfg), run.formatter)
        samples = [
            Sample(sequence, 1.0, group=t.maze_index, trajectory=i)
            for i, t in enumerate(trajectories)
            for sequence in training_sequences(run.formatter, t, cfg.env.history_window)
        ]
        update, t_train = timed(run.update.run, samples, self.loss, SFT_TEMPERATURE)
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        return {
            **run.rollout_metrics(trajectories, rewards),
            **update,
            "train/samples": run.world.sum([len(samples)])[0],
            "timing/generate_s": t_generate,
            "timing/train_s": t_train,
        }

    def loss(self, logprobs: torch.Tensor, micro: MicroBatch, normalizers: Normalizers):
        return sft_loss(logprobs, micro.batch["loss_mask"], normalizers.tokens), {}
