"""rlexp: Hydra-configured multi-turn GRPO for vision-language agents on 2D mazes."""

__version__ = "0.1.0"
