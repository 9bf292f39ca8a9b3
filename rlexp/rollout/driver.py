"""The multi-turn rollout driver: G samples per maze, stepped in lockstep until each episode ends."""

from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
import torch
from tqdm.auto import tqdm

from rlexp.envs import (
    BatchedMazeEnv,
    Maze,
    ModelView,
    format_action,
    instructions,
    model_frame,
    step_text,
    turn_text,
)
from rlexp.rollout.conversation import Trajectory, Turn, TurnFormatter, context_tokens
from rlexp.rollout.engine import GenerationOutput, GenerationRequest, InferenceEngine, SamplingParams


def stop_strings(action_format: str) -> list[str]:
    """``<action>…</action>`` replies end at the closing tag; tuple replies end at EOS or the token cap."""
    return ["</action>"] if action_format == "action_tag" else []


#: Chooses the replies of the active episodes at one turn: (env, episodes, active, trajectories, turn) -> outputs.
ReplyFn = Callable[[BatchedMazeEnv, list[Maze], np.ndarray, list[Trajectory], int], list[GenerationOutput]]


def run_episodes(
    mazes: Seq[Maze], env_cfg, samples_per_maze: int, max_turns: int, reply: ReplyFn, desc: str
) -> list[Trajectory]:
    """Play ``samples_per_maze`` episodes of each maze; trajectories are grouped maze-major.

    Episodes end independently, on ``stop`` or at the turn limit (``max_turns``, at most the env's
    ``max_steps``). Every reply is stepped through the env, malformed ones as invalid actions.
    Each turn records the frame as the model sees it (``env.image_format``); the prompt asks for
    ``<think>…</think><answer>…</answer>`` with ``env.elicit_verbalization`` (see ``ModelView``).
    """
    view = ModelView.from_config(env_cfg)
    action_format = _value(env_cfg.action_format)
    episodes = [maze for maze in mazes for _ in range(samples_per_maze)]
    # A turn limit below the env's step limit truncates episodes there, as the env's own limit would
    # (task reward 0, the format share still paid); the prompt keeps stating the env's limit, as VisGym's.
    env = BatchedMazeEnv(
        size=env_cfg.size,
        max_steps=min(env_cfg.max_steps, max_turns),
        cell_px=env_cfg.cell_px,
        terminate_on_goal=env_cfg.terminate_on_goal,
        format_reward=env_cfg.format_reward,
        action_format=action_format,
        elicit_verbalization=view.elicit_verbalization,
    )
    prompt = instructions(_value(env_cfg.prompt), action_format, env_cfg.size, view.elicit_verbalization)
    trajectories = [
        Trajectory(
            maze_index=i // samples_per_maze,
            sample_index=i % samples_per_maze,
            task_prompt=prompt,
            history_style=view.history_style,
        )
        for i in range(len(episodes))
    ]
    images = env.reset(episodes)
    feedback = [""] * len(episodes)
    done = np.zeros(len(episodes), dtype=bool)
    for turn_index in tqdm(range(max_turns), desc=desc, unit="turn", leave=False):
        active = np.flatnonzero(~done)
        if active.size == 0:
            break
        for i in active:
            if turn_index == 0:
                text = step_text(0, env_cfg.max_steps)
            else:
                text = turn_text(feedback[i], turn_index, env_cfg.max_steps)
            position = tuple(int(x) for x in env.agent_pos[i])
            image = model_frame(images[i], view.image_format)
            trajectories[i].turns.append(Turn(image=image, text=text, position=position))
        outputs = reply(env, episodes, active, trajectories, turn_index)
        actions: list[str | None] = [None] * len(episodes)
        for i, output in zip(active, outputs):
            turn = trajectories[i].turns[-1]
            turn.response_ids, turn.logprobs, turn.response_text = output.token_ids, output.logprobs, output.text
            actions[i] = output.text
        result = env.step(actions)
        images = result.images
        for i in active:
            trajectories[i].final_position = tuple(int(x) for x in env.agent_pos[i])
            trajectories[i].turns[-1].valid = bool(result.valid[i])
            trajectories[i].num_invalid += int(not result.valid[i])
            feedback[i] = result.feedback[i]
            if result.done[i]:
                done[i] = True
                trajectories[i].reward = float(result.reward[i])
                trajectories[i].success = bool(result.success[i])
    return trajectories


def run_rollouts(
    engine: InferenceEngine,
    formatter: TurnFormatter,
    mazes: Seq[Maze],
    env_cfg,
    samples_per_maze: int,
    sampling: SamplingParams,
    max_turns: int,
    desc: str = "rollout",
) -> list[Trajectory]:
    """Episodes played by the model behind ``engine``, one batched generate call per turn."""

    def reply(env, episodes, active, trajectories, turn_index):
        requests = []
        for i in active:
            context = context_tokens(formatter, trajectories[i], turn_index, env_cfg.history_window)
            requests.append(GenerationRequest(context.token_ids, context.images, context.vision))
        return engine.generate(requests, sampling)

    return run_episodes(mazes, env_cfg, samples_per_maze, max_turns, reply, desc)


def scripted_trajectories(
    policy, mazes: Seq[Maze], env_cfg, samples_per_maze: int, max_turns: int, formatter: TurnFormatter | None = None
) -> list[Trajectory]:
    """Episodes played by a scripted policy (``act(env, episodes) -> actions``: random, expert, …).

    With a ``formatter``, each reply is also tokenized as the model would emit it, ending with EOS:
    the BFS expert's trajectories are then SFT data.
    """
    action_format = _value(env_cfg.action_format)

    def reply(env, episodes, active, trajectories, turn_index):
        actions = policy.act(env, episodes)
        outputs = []
        for i in active:
            text = format_action(int(actions[i]), action_format)
            ids = []
            if formatter is not None:
                ids = formatter.processor.tokenizer.encode(text, add_special_tokens=False) + [formatter.eos_id]
            outputs.append(GenerationOutput(ids, [0.0] * len(ids), text, "stop"))
        return outputs

    return run_episodes(mazes, env_cfg, samples_per_maze, max_turns, reply, desc=type(policy).__name__)


def _value(option) -> str:
    """Enum-typed config values arrive as enums from a structured config and as str from plain dicts."""
    return getattr(option, "value", option)


def rollout_metrics(trajectories: list[Trajectory], rewards: torch.Tensor) -> dict[str, float]:
    """``rollout/…`` means over one step's episodes."""
    turns = sum(t.num_turns for t in trajectories)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/success_rate": sum(t.success for t in trajectories) / len(trajectories),
        "rollout/mean_turns": turns / len(trajectories),
        "rollout/invalid_action_rate": sum(t.num_invalid for t in trajectories) / max(turns, 1),
        "rollout/response_tokens_mean": sum(len(x.response_ids) for t in trajectories for x in t.turns) / max(turns, 1),
    }
