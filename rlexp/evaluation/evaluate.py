"""Evaluation on the pinned mazes: true success (stopped on the goal) with a 95% Wilson interval."""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlexp.envs import Maze, expert_actions
from rlexp.evaluation.visualize import save_episode_pictures
from rlexp.rollout.conversation import Trajectory, TurnFormatter
from rlexp.rollout.driver import run_rollouts, stop_strings
from rlexp.rollout.engine import InferenceEngine, SamplingParams


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate; sound at 0/n and n/n, unlike the normal one."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EvalResult:
    success_rate: float
    success_ci_low: float
    success_ci_high: float
    num_mazes: int
    turn_limit: int
    mean_turns: float
    invalid_action_rate: float
    #: mean over solved episodes of expert length / turns taken (1.0 = always the shortest path).
    optimal_path_ratio: float
    #: with k samples per maze: share of mazes solved by at least one sample.
    pass_at_k: float
    samples_per_maze: int
    #: mazes whose expert solution (moves + stop) fits the turn limit: the success rate's ceiling.
    solvable: int = 0
    per_maze: list[dict] = field(default_factory=list, repr=False)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        names = (
            "success_rate", "success_ci_low", "success_ci_high", "mean_turns",
            "invalid_action_rate", "optimal_path_ratio", "pass_at_k", "turn_limit",
        )
        metrics = {f"{prefix}{name}": float(getattr(self, name)) for name in names}
        metrics[f"{prefix}ceiling"] = self.solvable / max(1, self.num_mazes)
        return metrics

    def summary(self) -> str:
        return (
            f"success {self.success_rate:.1%} [{self.success_ci_low:.1%}, {self.success_ci_high:.1%}] "
            f"on {self.num_mazes} mazes at ≤{self.turn_limit} turns{self.ceiling_note()}; mean turns {self.mean_turns:.1f}, "
            f"invalid actions {self.invalid_action_rate:.1%}"
        )

    def ceiling_note(self) -> str:
        """Empty when every maze is solvable within the turn limit, else the ceiling it leaves."""
        if self.solvable >= self.num_mazes:
            return ""
        return f" (only {self.solvable}/{self.num_mazes} solvable in {self.turn_limit} turns: ceiling {self.solvable / self.num_mazes:.1%})"

    def write(self, path: Path) -> None:
        """Per-maze results as JSON lines, then the summary as ``<name>.summary.json``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in self.per_maze))
        summary = {k: v for k, v in asdict(self).items() if k != "per_maze"}
        path.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def solvable_within(mazes: list[Maze], turn_limit: int) -> int:
    """How many mazes the expert solves (moves + stop) within ``turn_limit`` turns."""
    return sum(len(expert_actions(maze)) <= turn_limit for maze in mazes)


def summarize(episodes: list[dict], mazes: list[Maze], turn_limit: int, samples_per_maze: int) -> EvalResult:
    """Aggregate per-episode rows (keys: maze, success, turns, invalid, expert_length)."""
    num_mazes = len(mazes)
    solved = [e for e in episodes if e["success"]]
    total_turns = sum(e["turns"] for e in episodes)
    low, high = wilson_interval(len(solved), len(episodes))
    mazes_solved = {e["maze"] for e in solved}
    return EvalResult(
        success_rate=len(solved) / max(1, len(episodes)),
        success_ci_low=low,
        success_ci_high=high,
        num_mazes=num_mazes,
        turn_limit=turn_limit,
        mean_turns=total_turns / max(1, len(episodes)),
        invalid_action_rate=sum(e["invalid"] for e in episodes) / max(1, total_turns),
        optimal_path_ratio=sum(e["expert_length"] / e["turns"] for e in solved) / len(solved) if solved else 0.0,
        pass_at_k=len(mazes_solved) / max(1, num_mazes),
        samples_per_maze=samples_per_maze,
        solvable=solvable_within(mazes, turn_limit),
        per_maze=episodes,
    )


def evaluate_model(
    engine: InferenceEngine,
    formatter: TurnFormatter,
    mazes: list[Maze],
    env_cfg,
    rollout_cfg,
    eval_cfg,
) -> tuple[EvalResult, list[Trajectory]]:
    """Greedy by default; with ``eval.greedy=false``, k samples per maze at the rollout temperature."""
    samples = 1 if eval_cfg.greedy else eval_cfg.samples_per_maze
    sampling = SamplingParams(
        temperature=0.0 if eval_cfg.greedy else rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        max_new_tokens=rollout_cfg.max_new_tokens_per_turn,
        stop=stop_strings(getattr(env_cfg.action_format, "value", env_cfg.action_format)),
    )
    turns = min(env_cfg.max_steps, rollout_cfg.max_turns)
    trajectories = run_rollouts(engine, formatter, mazes, env_cfg, samples, sampling, turns, desc="eval")
    return summarize(episode_rows(trajectories, mazes), mazes, turns, samples), trajectories


def episode_rows(trajectories: list[Trajectory], mazes: list[Maze]) -> list[dict]:
    """One JSON-friendly row per episode: what the per-maze results file holds."""
    return [
        {
            "maze": t.maze_index,
            "seed": mazes[t.maze_index].seed,
            "sample": t.sample_index,
            "success": t.success,
            "reward": t.reward,
            "turns": t.num_turns,
            "invalid": t.num_invalid,
            "expert_length": len(expert_actions(mazes[t.maze_index])),
            "replies": [turn.response_text for turn in t.turns],
        }
        for t in trajectories
    ]


#: eval episodes saved (and sent to the trackers) as a path PNG and a frames GIF at each eval.
EPISODES_PICTURED = 4


def record_eval(result: EvalResult, trajectories: list[Trajectory], mazes: list[Maze], path: Path, trackers, step: int, cell_px: int) -> None:
    """Per-maze rows and summary at ``path``, pictures of the first episodes beside it, all to the trackers."""
    result.write(path)
    trackers.log_metrics(result.metrics(), step)
    trackers.log_artifact(path)
    for trajectory in trajectories[:EPISODES_PICTURED]:
        maze = mazes[trajectory.maze_index]
        for picture in save_episode_pictures(maze, trajectory, path.with_suffix("") / f"maze_{maze.seed}", cell_px):
            trackers.log_artifact(picture)
