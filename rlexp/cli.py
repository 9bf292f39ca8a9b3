"""The one entrypoint: ``rlexp`` (or ``python -m rlexp``), a Hydra app whose ``task`` key picks the job."""

import difflib
import importlib
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlexp.config import ConfigError, register_configs, schema_keys, validate
from rlexp.tasks import TASKS

#: the config groups, shipped inside the package (so a wheel has them too).
CONF_DIR = Path(__file__).resolve().parent / "conf"


class UnknownKeyError(ValueError):
    pass


def check_override_keys(overrides: list[str]) -> None:
    """Fail fast, naming the valid keys, on ``a.b=value`` overrides whose key the schema does not have.

    Hydra rejects plain ones too, without listing what is valid, but lets ``+key=…`` add keys even to
    typed nodes, so both are checked here. ``~key`` (delete), ``hydra.*``, the free-form ``logger``
    node and group choices (``model=tiny``) are left to Hydra.
    """
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+")
        if override.startswith(("-", "~")) or key.startswith("hydra") or "=" not in override:
            continue
        parent, _, leaf = key.rpartition(".")
        valid = schema_keys(parent)
        if valid is None or leaf in valid or "/" in key or "@" in key:
            continue
        hint = difflib.get_close_matches(leaf, valid, n=1)
        hint_text = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise UnknownKeyError(
            f"unknown config key '{key}'{hint_text}; valid keys under '{parent or '<root>'}': {', '.join(valid)}"
        )


def run_task(cfg: DictConfig):
    """Validate, then run the chosen task; configuration mistakes end with one line, not a traceback."""
    task = cfg.task.value
    try:
        if task not in TASKS:
            raise ConfigError(f"task={task} is not implemented yet; available now: {', '.join(TASKS)}")
        validate(cfg)
    except ConfigError as error:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the job is marked failed; the sweep's other jobs still run
        sys.exit(f"rlexp: {error}")
    module_name, function_name = TASKS[task].split(":")
    return getattr(importlib.import_module(module_name), function_name)(cfg)


register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig):
    return run_task(cfg)


def main() -> None:
    try:
        check_override_keys(sys.argv[1:])
    except UnknownKeyError as error:
        sys.exit(f"rlexp: {error}")
    hydra_main()
