"""The one entrypoint: ``rlexp`` (or ``python -m rlexp``), a Hydra app whose ``task`` key picks the job.

Before Hydra composes anything, ``check_override_keys`` reads the command line's overrides against the
schema and the config groups, so that a misspelt key, a value of the wrong type or an unknown group
option ends with one line naming it and what is valid. After composition, ``prepare`` runs
``validate`` (ranges and combinations) and ``check_machine``, still before any model loads.
"""

import difflib
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType, ValueType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlexp.cluster import RAY_JOB_PAYLOAD
from rlexp.config import COMPUTE_TASKS, VLLM_ENGINE, ConfigError, register_configs, schema_keys, schema_node, validate
from rlexp.planning import check_fit, visible_gpu_gb
from rlexp.runtime import cluster_choice
from rlexp.tasks import TASKS

log = logging.getLogger(__name__)

#: the config groups, shipped inside the package (so a wheel has them too).
CONF_DIR = Path(__file__).resolve().parent / "conf"


class UnknownKeyError(ConfigError):
    """An override whose key, value type or group option the config does not have."""


def group_options(group: str, config_dirs: tuple[Path, ...] = ()) -> list[str] | None:
    """The options of a config group (``model`` -> ``[qwen3_vl_2b, …]``), or None if ``group`` is not one."""
    folders = [d / group for d in (CONF_DIR, *config_dirs) if (d / group).is_dir()]
    if not folders:
        return None
    return sorted({p.relative_to(f).with_suffix("").as_posix() for f in folders for p in f.rglob("*.yaml")})


def check_override_keys(overrides: list[str], config_dirs: tuple[Path, ...] = ()) -> None:
    """Refuse, in one line, an override the config cannot take: an unknown key (naming the closest one and
    every valid key), a value of the wrong type, or a group option that does not exist (listing them).

    Hydra refuses most of these too, but in several lines, advising ``+key`` for a misspelt parent, and
    lets ``+key=…`` add keys to typed nodes. ``~key``, ``hydra.*``, ``hydra/…`` groups, package
    overrides (``group@pkg``) and free-form nodes (``logger.mlflow.tags``) are left to Hydra.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as error:
        raise UnknownKeyError(str(error).splitlines()[0]) from None
    choices = {o.key_or_group: o for o in parsed if "." not in o.key_or_group and not o.is_delete()}
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or key.startswith("hydra") or "/" in key or override.package is not None:
            continue
        options = group_options(key, config_dirs) if "." not in key else None
        if options is not None:
            _check_group_choice(override, options)
        else:
            _check_key(override)
            _check_logger_selected(override, choices.get("logger"))


def _values(override: Override) -> list[Any]:
    """The concrete values an override sets (each of a sweep's); none for interval sweeps and interpolations."""
    if override.value_type == ValueType.INTERVAL_SWEEP:
        return []
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    return [v for v in values if not (isinstance(v, str) and "${" in v)]


def default_choice(group: str) -> Any:
    """The option ``conf/config.yaml``'s defaults list picks for ``group``."""
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if OmegaConf.is_dict(entry) and group in entry:
            return entry[group]
    return None


def _check_group_choice(override: Override, options: list[str]) -> None:
    group = override.key_or_group
    if override.type == OverrideType.ADD and default_choice(group) is not None:
        raise UnknownKeyError(
            f"'{override.input_line}': '{group}' has a default option already; write {override.input_line[1:]} (no '+')"
        )
    for value in _values(override):
        for option in value if isinstance(value, list) else [value]:
            if option is not None and str(option) not in options:
                hint = difflib.get_close_matches(str(option), options, n=1)
                hint_text = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise UnknownKeyError(f"{group}={option} is not an option of '{group}'{hint_text}; options: {', '.join(options)}")


def _check_key(override: Override) -> None:
    key = override.key_or_group
    parts = key.split(".")
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        valid = schema_keys(parent)
        if valid is None:
            return  # below a free-form node (a dict or list the schema does not type)
        if part not in valid:
            hint = difflib.get_close_matches(part, valid, n=1)
            hint_text = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise UnknownKeyError(
                f"unknown config key '{'.'.join(parts[: depth + 1])}' in '{override.input_line}'{hint_text}; "
                f"valid keys under '{parent or '<root>'}': {', '.join(valid)}"
            )
    if override.type == OverrideType.ADD:
        raise UnknownKeyError(f"'{override.input_line}': {key} exists already; drop the '+' ({override.input_line[1:]})")
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.structured(schema_node(parent))
    for value in _values(override):
        try:
            node[leaf] = value
        except OmegaConfBaseException as error:
            raise UnknownKeyError(f"{key}={value}: {str(error).splitlines()[0]}") from None


def _check_logger_selected(override: Override, logger_choice: Override | None) -> None:
    """``logger.wandb.x=…`` sets an option of a tracker that exists only when the ``logger`` group selects it
    (the command line's ``logger=…``, else the default; no experiment selects a logger)."""
    parts = override.key_or_group.split(".")
    if parts[0] != "logger" or len(parts) < 3:
        return
    chosen = _values(logger_choice) if logger_choice is not None else [default_choice("logger")]
    for choice in chosen:
        selected = [str(c) for c in (choice if isinstance(choice, list) else [choice])]
        if parts[1] not in selected:
            raise UnknownKeyError(
                f"{override.key_or_group}: the {parts[1]} tracker is not selected (logger={','.join(selected)}); "
                f"add it with logger={parts[1]} or logger=[mlflow,wandb]"
            )


def prepare(cfg: DictConfig) -> None:
    """Everything checked before a task runs: the task exists, ``validate``, for tasks that load a model
    ``check_machine``, and for training the memory plan (``check_fit``). Raises ``ConfigError`` (one line)."""
    task = cfg.task.value
    if task not in TASKS:
        raise ConfigError(f"task={task} is not implemented yet; available now: {', '.join(TASKS)}")
    validate(cfg)
    on_ray = cfg.cluster.launcher.value == "ray"  # the machines are the Ray cluster's, not this one
    if task in COMPUTE_TASKS and not (task == "eval" and cfg.eval.policy.value != "model") and not on_ray:
        check_machine(cfg)
    if task == "train":
        check_fit(cfg, cluster_choice())


def check_machine(cfg: Any) -> None:
    """What ``cluster`` promises, checked against this machine before any model loads: the device exists
    and has at least ``gpu_memory_gb``, and the host at least ``cpu_memory_gb`` (5% slack for GB/GiB
    rounding in vendors' figures); ``rollout=vllm`` finds vLLM installed."""
    cluster = cfg.cluster
    if str(cluster.device).startswith("cuda"):
        _check_cuda_device(cluster)
    if cfg.rollout.engine._target_ == VLLM_ENGINE:
        from rlexp.rollout.vllm_engine import vllm_missing

        if reason := vllm_missing():
            raise ConfigError(reason)
    host_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    if host_gb < 0.95 * cluster.cpu_memory_gb:
        raise ConfigError(
            f"cluster.cpu_memory_gb={cluster.cpu_memory_gb} but this machine has {host_gb:.1f} GB; pick the cluster "
            "option that matches it"
        )


def _check_cuda_device(cluster: Any) -> None:
    """The device first: on a machine without it, that is the one thing to say."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"cluster.device={cluster.device} but no CUDA device is visible here; use cluster=local_cpu")
    index = int(cluster.device.partition(":")[2] or 0)
    if cluster.gpus_per_node > torch.cuda.device_count():
        raise ConfigError(
            f"cluster.gpus_per_node={cluster.gpus_per_node} but this machine has {torch.cuda.device_count()} CUDA devices"
        )
    if index >= torch.cuda.device_count():
        raise ConfigError(f"cluster.device={cluster.device} but this machine has {torch.cuda.device_count()} CUDA devices")
    device_gb = visible_gpu_gb(cluster.device)
    if device_gb < 0.95 * cluster.gpu_memory_gb:
        raise ConfigError(
            f"cluster.gpu_memory_gb={cluster.gpu_memory_gb} but cuda:{index} has {device_gb:.1f} GB; pick the cluster "
            "option that matches it"
        )


def run_task(cfg: DictConfig):
    """Prepare, then run the chosen task (with ``cluster.launcher=ray``, training is submitted to the Ray
    cluster instead, see ``rlexp.cluster.ray_jobs``); configuration mistakes end with one line, not a traceback. In a
    multirun the job is recorded as a FAILED tracker run with the error as a tag, then fails, so that the
    sweep's other jobs still run and the sweep reports the failure."""
    try:
        prepare(cfg)
        if cfg.cluster.launcher.value == "ray" and cfg.task.value == "train" and RAY_JOB_PAYLOAD not in os.environ:
            from rlexp.cluster.ray_jobs import submit

            return submit(cfg)
    except ConfigError as error:
        if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
            sys.exit(f"rlexp: {error}")
        record_refused_job(cfg, error)
        raise
    module_name, function_name = TASKS[cfg.task.value].split(":")
    return getattr(importlib.import_module(module_name), function_name)(cfg)


def record_refused_job(cfg: DictConfig, error: ConfigError) -> None:
    """A FAILED run in each tracker, with the config as params and the refusal as the ``error`` tag."""
    from rlexp.runtime import run_dir_of
    from rlexp.tracking import build_trackers

    try:
        trackers = build_trackers(cfg.logger, run_dir_of(cfg), cfg)
    except Exception:  # a bad logger option may be what was refused
        log.warning("could not record the refused job in the trackers", exc_info=True)
        return
    trackers.set_tags({"error": str(error)})
    trackers.finish("FAILED")


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig):
    return run_task(cfg)


def main() -> None:
    args = get_args_parser().parse_args(sys.argv[1:])
    config_dirs = (Path(args.config_dir),) if args.config_dir else ()
    try:
        check_override_keys(args.overrides, config_dirs)
    except ConfigError as error:
        sys.exit(f"rlexp: {error}")
    hydra_main()
