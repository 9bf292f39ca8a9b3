"""``rollout=turn_batch``: a step's episodes of one-image turns played as tensors, replies constrained to the moves.

With ``env.history_window=1`` each turn shows the policy one frame and one of a few turn texts
(``rlexp.models.fast_policy.TurnLayout``), and each action is one token of the tokenizer. This engine
plays all of a step's episodes together, one batched forward a turn (``FastTurnForward``) on frames drawn
on the device (``rlexp.envs.gpu_frames.FrameEncoder``); the moves are stepped through ``BatchedMazeEnv``,
the rules' one home. The update scores the same turns with the same forward (``ActionTurnScorer``),
instead of building a token sequence a turn through the processor.

Replies are sampled from the policy restricted to the five action tokens, each followed by
``<|im_end|>``, as a grammar constrains decoding: no training reply is invalid, and the log-probs, sampled
and scored, are over those five tokens. ``generate`` is ``HFEngine``'s, unconstrained, so evaluation
keeps the eval protocol (greedy over the whole vocabulary, malformed replies are invalid actions).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from rlexp.config import check_turn_batch_env
from rlexp.envs import ACTION_EXECUTED, WALL_BUMP, BatchedMazeEnv, Maze
from rlexp.envs.gpu_frames import FrameEncoder
from rlexp.models.fast_policy import FastTurnForward, TurnLayout, freeze_vision_pos_embed, variant_index
from rlexp.rollout.hf_engine import HFEngine

#: the feedback a valid move can get, in the order of ``TurnLayout``'s rows.
FEEDBACKS = (ACTION_EXECUTED, WALL_BUMP)


@dataclass
class PlayedBatch:
    """A step's episodes, maze-major (``samples_per_maze`` consecutive episodes a maze), as tensors on the
    policy's device; ``[e, t]`` is episode ``e``'s turn ``t``, recorded where ``taken``."""

    walls: torch.Tensor  # (E, H, W) bool
    goals: torch.Tensor  # (E, 2) long
    positions: torch.Tensor  # (E, T, 2) long: the agent where the turn's frame shows it
    variants: torch.Tensor  # (E, T) long: the turn's row of the layout
    actions: torch.Tensor  # (E, T) long: 0..4
    logprobs: torch.Tensor  # (E, T) float32, of the action among the five at the sampling temperature
    taken: torch.Tensor  # (E, T) bool
    rewards: torch.Tensor  # (E,) float32, on the CPU
    success: torch.Tensor  # (E,) bool, on the CPU
    samples_per_maze: int

    @property
    def num_turns(self) -> int:
        return int(self.taken.sum())

    @property
    def generated_tokens(self) -> int:
        return 2 * self.num_turns  # the action and <|im_end|>

    def sequences(self) -> list[tuple[ActionTurn, int]]:
        """(training sequence, episode) for each turn: GRPO's per-turn sequences at a history window of 1."""
        episodes, turns = self.taken.nonzero(as_tuple=True)
        return [(ActionTurn(self, e, t), e) for e, t in zip(episodes.tolist(), turns.tolist())]

    def metrics(self) -> dict[str, float]:
        """``rollout/…`` as ``rlexp.rollout.driver.rollout_metrics`` names them."""
        turns = self.num_turns
        return {
            "rollout/reward_mean": float(self.rewards.mean()),
            "rollout/success_rate": float(self.success.float().mean()),
            "rollout/mean_turns": turns / len(self.rewards),
            "rollout/invalid_action_rate": 0.0,
            "rollout/response_tokens_mean": 2.0,
        }


@dataclass(frozen=True)
class ActionTurn:
    """The training sequence of one played turn, by reference: its episode and turn in ``played``."""

    played: PlayedBatch
    episode: int
    turn: int


class TurnBatchEngine(HFEngine):
    """``HFEngine`` (for evaluation and any other ``generate``) that plays training episodes as tensors."""

    def __init__(self, model, processor, static_cache: bool = False, autocast: str | None = None):
        """``autocast``: the dtype (``bfloat16``) the fast forward of play and scoring runs in under
        ``torch.autocast``; the same forward for both, so the update's log-probs still equal the engine's."""
        super().__init__(model, processor, static_cache=static_cache)
        self.autocast_dtype = getattr(torch, autocast) if autocast else None
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        freeze_vision_pos_embed(self.base)
        self.scorer = ActionTurnScorer(self)
        #: the env settings the layout, encoder and fast forward were built for.
        self._built_for: tuple | None = None

    def prepare(self, env_cfg) -> None:
        """The layout, frame encoder and fast forward of ``env_cfg``'s turns (built once per setting)."""
        check_turn_batch_env(env_cfg)
        key = (env_cfg.size, env_cfg.cell_px, env_cfg.max_steps, str(env_cfg.prompt.value), str(env_cfg.action_format.value))
        if self._built_for == key:
            return
        size, cell_px, max_steps, prompt, action_format = key
        device = self.device
        self.layout = TurnLayout.build(self.processor, size, cell_px, max_steps, prompt, action_format, FEEDBACKS).to(device)
        dtype = next(self.base.model.visual.parameters()).dtype
        self.encoder = FrameEncoder.from_processor(self.processor, size, cell_px, device=device, dtype=dtype)
        corner = torch.ones(1, size, size, dtype=torch.bool)
        corner[0, 1:-1, 1:-1] = False
        pixel_values, grid = self.encoder.encode(corner, torch.tensor([[1, 1]]), torch.tensor([[1, 2]]))
        self.fast = FastTurnForward(self.base, self.layout, pixel_values, grid)
        self._built_for = key

    def action_logits(self, walls, positions, goals, variants, actions=None) -> torch.Tensor:
        """(B, 5) logits of the five action tokens at each turn's reply; ``actions`` are written into the
        reply (they do not change these logits, which come before them)."""
        pixel_values, _ = self.encoder.encode(walls, positions, goals)
        ids, predict = self.layout.batch(variants, actions)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            logits = self.fast(ids, pixel_values, predict[:, None])[:, 0]
        return logits[:, self.layout.action_token_ids].float()

    @torch.no_grad()
    def play(self, mazes: Seq[Maze], env_cfg, samples_per_maze: int, temperature: float, max_turns: int) -> PlayedBatch:
        """``samples_per_maze`` episodes of each maze to their end or ``max_turns``; ``temperature`` 0 is greedy.
        Episodes end as in ``rlexp.rollout.driver.run_episodes``, through the same env."""
        self.prepare(env_cfg)
        device = self.device
        episodes = [maze for maze in mazes for _ in range(samples_per_maze)]
        env = BatchedMazeEnv(
            size=env_cfg.size, max_steps=min(env_cfg.max_steps, max_turns), cell_px=env_cfg.cell_px,
            terminate_on_goal=env_cfg.terminate_on_goal, format_reward=env_cfg.format_reward,
            action_format=env_cfg.action_format.value,
        )
        env.reset(episodes)
        n, turns = len(episodes), env.max_steps
        walls = torch.from_numpy(np.stack([m.grid for m in episodes])).to(device)
        goals = torch.tensor([m.goal for m in episodes], device=device)
        positions = torch.zeros(n, turns, 2, dtype=torch.long, device=device)
        variants = torch.zeros(n, turns, dtype=torch.long, device=device)
        actions = torch.zeros(n, turns, dtype=torch.long, device=device)
        logprobs = torch.zeros(n, turns, dtype=torch.float32, device=device)
        taken = torch.zeros(n, turns, dtype=torch.bool, device=device)
        rewards = np.zeros(n, dtype=np.float32)
        bumped = np.zeros(n, dtype=bool)
        was_training = self.model.training
        self.model.eval()
        try:
            for t in range(turns):
                active = np.flatnonzero(~env.done)
                if active.size == 0:
                    break
                rows = torch.from_numpy(active).to(device)
                pos = torch.from_numpy(env.agent_pos[active]).to(device)
                variant = variant_index(t, torch.from_numpy(bumped[active]).to(device).long()) if t else torch.zeros_like(rows)
                logits = self.action_logits(walls[rows], pos, goals[rows], variant)
                if temperature > 0:
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    action = torch.multinomial(logp.exp(), 1)[:, 0]
                else:
                    logp = torch.log_softmax(logits, dim=-1)
                    action = logits.argmax(-1)
                positions[rows, t], variants[rows, t], actions[rows, t] = pos, variant, action
                logprobs[rows, t] = logp.gather(1, action[:, None])[:, 0]
                taken[rows, t] = True
                step_actions = np.zeros(n, dtype=np.int64)
                step_actions[active] = action.cpu().numpy()
                result = env.step(step_actions)
                bumped = np.array([f == WALL_BUMP for f in result.feedback])
                ended = result.done & result.active
                rewards[ended] = result.reward[ended]
        finally:
            self.model.train(was_training)
        return PlayedBatch(
            walls, goals, positions, variants, actions, logprobs, taken,
            torch.from_numpy(rewards), torch.from_numpy(env.success.copy()), samples_per_maze,
        )


class ActionTurnScorer:
    """``rlexp.training.update.PolicyUpdate``'s scorer for ``ActionTurn`` samples: one log-prob a sample, of its
    action among the five, through the engine's fast forward."""

    def __init__(self, engine: TurnBatchEngine):
        self.engine = engine

    def batch(self, samples: list, device) -> dict[str, torch.Tensor]:
        played = samples[0].sequence.played
        episode = torch.tensor([s.sequence.episode for s in samples], device=played.walls.device)
        turn = torch.tensor([s.sequence.turn for s in samples], device=played.walls.device)
        return {
            "walls": played.walls[episode],
            "positions": played.positions[episode, turn],
            "goals": played.goals[episode],
            "variants": played.variants[episode, turn],
            "actions": played.actions[episode, turn],
            "engine_logprobs": played.logprobs[episode, turn][:, None],
            "loss_mask": torch.ones(len(samples), 1, device=played.walls.device),
        }

    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 1) log-probs of the batch's actions and (B, 1) entropies, over the five action tokens."""
        logits = self.engine.action_logits(batch["walls"], batch["positions"], batch["goals"], batch["variants"], batch["actions"])
        logp = torch.log_softmax(logits / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        return logp.gather(1, batch["actions"][:, None]), entropy.detach()

    def width(self, sample) -> int:
        return 1

    def tokens(self, sample) -> int:
        return 1

    def engine_logprobs(self, micro) -> torch.Tensor:
        return micro.batch["engine_logprobs"]
