"""Every option of every config group composes, typed; bad keys and values fail with clear errors."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose_config
from rlexp.cli import CONF_DIR, UnknownKeyError, check_override_keys
from rlexp.config import (
    AlgorithmConfig,
    ConfigError,
    EnvConfig,
    LoggerConfig,
    MlflowTrackerConfig,
    ModelConfig,
    WandbTrackerConfig,
    validate,
)

GROUPS = ("model", "cluster", "env", "algorithm", "rollout", "logger", "eval", "experiment")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


ALL_OPTIONS = [(group, option) for group in GROUPS for option in _options(group)]
#: options that compose but describe runs that are not implemented yet: validation refuses them, naming this key.
REFUSED = {
    ("rollout", "vllm"): "cluster.device",  # vLLM needs the GPU; test_rollout_vllm_validates_on_one_gpu
    # the default view is VisGym's JPEG history; test_rollout_turn_batch_validates_for_the_repro
    ("rollout", "turn_batch"): "env.image_format",
}


@pytest.mark.parametrize("option", [o for g, o in ALL_OPTIONS if g == "cluster"])
def test_every_cluster_option_plans(option):
    """``task=plan`` reads every cluster option, whatever training can run."""
    validate(compose_config(f"cluster={option}", "task=plan"))


def test_every_group_has_options():
    assert {g for g, _ in ALL_OPTIONS} == set(GROUPS)
    for required in ("env/maze_easy", "env/maze_hard", "cluster/local_cpu", "algorithm/grpo", "model/tiny"):
        assert tuple(required.split("/")) in ALL_OPTIONS


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_and_validates(group, option):
    cfg = compose_config(f"{group}={option}")
    assert OmegaConf.get_type(cfg.model) is ModelConfig
    assert OmegaConf.get_type(cfg.env) is EnvConfig
    assert OmegaConf.get_type(cfg.algorithm) is AlgorithmConfig
    OmegaConf.to_container(cfg.model, resolve=True, throw_on_missing=True)
    if (group, option) in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[group, option]):
            validate(cfg)
    else:
        validate(cfg)


def test_seed_recipe_validates_on_one_gpu():
    validate(compose_config("experiment=visgym_maze_grpo", "cluster=gpu_1x"))


def test_rollout_turn_batch_validates_for_the_repro():
    validate(compose_config("experiment=tiny_maze_repro", "rollout=turn_batch"))


def test_rollout_vllm_validates_on_one_gpu():
    cfg = compose_config("rollout=vllm", "cluster=gpu_1x", "rollout.max_turns=7", "seed=3")
    validate(cfg)
    assert (cfg.rollout.engine.max_images_per_prompt, cfg.rollout.engine.seed) == (7, 3)
    assert cfg.rollout.engine.static_cache is None and compose_config().rollout.engine.sleep_level is None


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["rollout.engine.sleep_level=1"], "rollout.engine.sleep_level"),  # a vLLM option on the hf engine
        (["rollout=vllm", "cluster=gpu_1x", "rollout.engine.static_cache=true"], "rollout.engine.static_cache"),
        (["rollout=vllm", "cluster=gpu_1x", "rollout.engine.sleep_level=2"], "rollout.engine.sleep_level"),
        (["rollout=vllm", "cluster=gpu_1x", "cluster.device=cuda:1"], "cluster.device"),
        (["rollout=vllm", "cluster=gpu_1x", "model.lora.rank=1024"], "model.lora.rank"),
    ],
)
def test_engine_options_are_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        validate(compose_config(*overrides))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "choice,selected",
    [("logger=mlflow", {"mlflow"}), ("logger=wandb", {"wandb"}), ("logger=[mlflow,wandb]", {"mlflow", "wandb"}), ("logger=none", set())],
)
def test_logger_options_are_typed(choice, selected):
    cfg = compose_config(choice)
    assert OmegaConf.get_type(cfg.logger) is LoggerConfig
    assert {name for name in ("mlflow", "wandb") if cfg.logger[name] is not None} == selected
    if "mlflow" in selected:
        assert OmegaConf.get_type(cfg.logger.mlflow) is MlflowTrackerConfig and cfg.logger.mlflow.flush_timeout_s == 30
    if "wandb" in selected:
        assert OmegaConf.get_type(cfg.logger.wandb) is WandbTrackerConfig and cfg.logger.wandb.project == "rlexp"


def test_logger_option_of_wrong_type_fails_at_composition():
    with pytest.raises(Exception) as error:
        compose_config("logger.mlflow.flush_timeout_s=soon")
    assert "flush_timeout_s" in _messages(error.value) and "soon" in _messages(error.value)


@pytest.mark.parametrize("experiment", _options("experiment"))
@pytest.mark.parametrize("group,option", [(g, o) for g, o in ALL_OPTIONS if g not in ("experiment",)])
def test_experiment_with_any_option_composes(experiment, group, option):
    cfg = compose_config(f"experiment={experiment}", f"{group}={option}")
    assert OmegaConf.get_type(cfg.rollout).__name__ == "RolloutConfig"


def test_seed_recipe_values():
    cfg = compose_config("experiment=visgym_maze_grpo")
    assert cfg.model.path == "Qwen/Qwen3-VL-8B-Instruct" and cfg.model.lora.rank == 32
    assert (cfg.algorithm.n_samples_per_prompt, cfg.algorithm.train_batch_size) == (8, 32)
    assert (cfg.rollout.max_turns, cfg.rollout.temperature) == (20, 0.7)  # VisGym's limit, not the seed's 15
    assert (cfg.eval_interval, cfg.ckpt_interval, cfg.total_steps) == (10, 20, 160)
    assert cfg.cluster.nodes * cfg.cluster.gpus_per_node == 6


def test_hard_env_values():
    cfg = compose_config("env=maze_hard")
    assert (cfg.env.size, cfg.env.max_steps, cfg.env.pinned_set) == (11, 30, "maze_hard")


def _messages(error: BaseException) -> str:
    """Hydra wraps OmegaConf's error; its message is on the cause."""
    return " | ".join(str(e) for e in (error, error.__cause__) if e is not None)


def test_wrong_type_fails_at_composition_naming_the_key():
    with pytest.raises(Exception) as error:
        compose_config("algorithm.lr=fast")
    assert "algorithm.lr" in _messages(error.value) and "fast" in _messages(error.value)


def test_wrong_enum_value_lists_choices():
    with pytest.raises(Exception) as error:
        compose_config("env.action_format=json")
    assert "visgym_tuple, action_tag" in _messages(error.value)


def test_unknown_key_names_valid_keys():
    with pytest.raises(UnknownKeyError, match=r"'algorithm.lrr'.*did you mean 'lr'.*n_samples_per_prompt"):
        check_override_keys(["algorithm.lrr=1"])
    with pytest.raises(UnknownKeyError, match="model.foo"):
        check_override_keys(["+model.foo=1"])
    with pytest.raises(UnknownKeyError, match=r"'algoritm'.*did you mean 'algorithm'.*valid keys under '<root>'"):
        check_override_keys(["+algoritm.lr=1"])


def test_good_overrides_pass_the_key_check():
    check_override_keys([
        "algorithm.lr=1", "model=tiny", "hydra.run.dir=x", "experiment=visgym_maze_grpo", "experiment=tiny_cpu",
        "logger=[mlflow,wandb]", "logger.mlflow.tags={owner: me}", "model.lora.target_modules=[q_proj]",
        "algorithm.n_samples_per_prompt=4,8", "algorithm.lr=tag(log, interval(1e-5, 1e-2))", "seed=range(0,3)",
        "model.lora.alpha=${model.lora.rank}", "~checkpoint", "++algorithm.lr=2", "cluster=gpu_1x,local_cpu",
    ])
    check_override_keys(["logger=none"])
    check_override_keys(["logger=wandb", "logger.wandb.project=x", "logger.wandb.mode=offline"])


@pytest.mark.parametrize(
    "overrides,keys",
    [
        (["algorithm.train_batch_size=4", "algorithm.policy_mini_batch_size=3"], ["policy_mini_batch_size", "train_batch_size"]),
        (["algorithm.n_samples_per_prompt=1"], ["n_samples_per_prompt", "norm_by_std"]),
        (["rollout.max_turns=25"], ["rollout.max_turns", "env.max_steps"]),
        (["env.size=8"], ["env.size"]),
        (["eval.num_mazes=65"], ["eval.num_mazes"]),
    ],
)
def test_incompatible_settings_name_both_keys(overrides, keys):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    for key in keys:
        assert key in str(error.value)


def _rlexp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlexp", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_prints_composed_config():
    result = _rlexp("--cfg", "job", "env=maze_hard", "algorithm.lr=0.5")
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.env.size == 11 and printed.algorithm.lr == 0.5


def test_cli_help_lists_groups():
    result = _rlexp("--help")
    assert result.returncode == 0
    assert "env: maze_easy, maze_hard" in result.stdout


def test_cli_unknown_key_is_one_clear_line():
    result = _rlexp("algorithm.learning_rate=1")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        next(line for line in result.stderr.splitlines() if line.startswith("rlexp: unknown config key"))
    ]


def test_cli_unknown_option_lists_choices():
    result = _rlexp("env=maze_huge")
    assert result.returncode != 0 and "maze_easy" in result.stderr and "maze_hard" in result.stderr


def test_cli_incompatible_settings_fail_before_loading():
    result = _rlexp("algorithm.train_batch_size=2", "algorithm.policy_mini_batch_size=3", "hydra.run.dir=/tmp/rlexp-test-unused")
    assert result.returncode != 0
    assert "policy_mini_batch_size=3" in result.stderr and "train_batch_size=2" in result.stderr
    assert "Traceback" not in result.stderr
