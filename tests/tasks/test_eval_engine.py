"""``task=eval checkpoint=…`` takes the checkpoint's settings, but generates with this command's engine."""

from omegaconf import OmegaConf

from conftest import compose_config
from rlexp.config import VLLM_ENGINE
from rlexp.tasks.eval import with_checkpoint_config


def test_a_checkpoint_is_evaluated_with_this_commands_engine(tmp_path):
    """``task=eval checkpoint=… rollout=vllm``: the checkpoint's sampling settings, this machine's engine."""
    OmegaConf.save(compose_config("name=t", "rollout.max_turns=3"), tmp_path / "config.yaml")
    cfg = with_checkpoint_config(compose_config("name=t", "task=eval", "rollout=vllm", "cluster=gpu_1x"), tmp_path)
    assert cfg.rollout.engine._target_ == VLLM_ENGINE and cfg.rollout.max_turns == 3
