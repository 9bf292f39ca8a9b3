"""Pictures of episodes: the maze with the path taken (PNG) and the frames the model saw (GIF)."""

from pathlib import Path

from PIL import Image, ImageDraw

from rlexp.envs import Maze, render
from rlexp.rollout.conversation import Trajectory

PATH_COLOUR = (255, 165, 0)


def path_image(maze: Maze, trajectory: Trajectory, cell_px: int = 25) -> Image.Image:
    """The maze at the final position, the path drawn through cell centres, success in the caption."""
    image = Image.fromarray(render(maze, trajectory.final_position, cell_px))
    points = [turn.position for turn in trajectory.turns] + [trajectory.final_position]
    centres = [(c * cell_px + cell_px // 2, r * cell_px + cell_px // 2) for r, c in points]
    draw = ImageDraw.Draw(image)
    if len(centres) > 1:
        draw.line(centres, fill=PATH_COLOUR, width=max(2, cell_px // 6))
    caption = Image.new("RGB", (image.width, 14), "white")
    ImageDraw.Draw(caption).text(
        (2, 1), f"seed {maze.seed}: {'solved' if trajectory.success else 'not solved'} in {trajectory.num_turns} turns", fill="black"
    )
    out = Image.new("RGB", (image.width, image.height + caption.height), "white")
    out.paste(caption, (0, 0))
    out.paste(image, (0, caption.height))
    return out


def save_episode_pictures(maze: Maze, trajectory: Trajectory, stem: Path, cell_px: int = 25) -> list[Path]:
    """``<stem>.png`` (the path) and ``<stem>.gif`` (each observed frame, then the final state)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    png, gif = stem.with_suffix(".png"), stem.with_suffix(".gif")
    path_image(maze, trajectory, cell_px).save(png)
    frames = [Image.fromarray(turn.image) for turn in trajectory.turns]
    frames.append(Image.fromarray(render(maze, trajectory.final_position, cell_px)))
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=500, loop=0)
    return [png, gif]


