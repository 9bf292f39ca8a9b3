"""Airtight configs: every key of the schema is read by the code, or validation refuses any other value than
its default with one line until it works. Every number has a range."""

import ast
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

from conftest import compose_config
from rlexp.cli import prepare
from rlexp.config import ENGINE_OPTIONS, ConfigError, EngineConfig, field_type, schema_leaves, schema_node

PACKAGE = Path(__file__).resolve().parent.parent / "rlexp"
#: keys that nothing reads yet, each with a value other than its default that validation must refuse.
REFUSED: dict[str, str] = {}
#: keys ``task=plan`` reads, with a value training cannot run on the local launchers (multi-node runs need Ray), which it must refuse.
NOT_FOR_TRAINING = {
    "cluster.ray.workers": "2",
    "cluster.nodes": "2",
    "cluster.head": "ml.r5d.16xlarge",
    "cluster.shared_storage": "/fsx",
}
#: read by ``hydra.utils.instantiate``, not by attribute access.
INSTANTIATE_KEYS = ("_target_", "_partial_")


def _names_read() -> set[str]:
    """Attribute names read (``x.name``) and string subscripts (``x["name"]``) anywhere in rlexp/ outside
    config.py, where the schema itself and its checks live."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                names.add(node.slice.value)
    return names


def _parameters(target: str) -> set[str]:
    """The parameters ``instantiate`` can pass to ``target``: from the source for rlexp's own classes (no
    import of mlflow, wandb or transformers), else by signature."""
    module, _, name = target.rpartition(".")
    if module.startswith("rlexp."):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
                return {a.arg for a in init.args.args + init.args.kwonlyargs}
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return {a.arg for a in node.args.args + node.args.kwonlyargs}
        raise AssertionError(f"{target} not found")
    obj = getattr(importlib.import_module(module), name)
    return set(inspect.signature(obj).parameters)


LEAVES = [key for key, _ in schema_leaves()]


@pytest.fixture(scope="module")
def names_read():
    return _names_read()


@pytest.mark.parametrize("key", LEAVES)
def test_every_key_is_read_or_refused(key, names_read):
    parent, _, leaf = key.rpartition(".")
    node = schema_node(parent)
    if key in REFUSED:
        cfg = compose_config(f"{key}={REFUSED[key]}")
        with pytest.raises(ConfigError) as error:
            prepare(cfg)
        assert "\n" not in str(error.value) and key in str(error.value), str(error.value)
    elif node is EngineConfig:
        # every engine's options, each passed only to the engine that reads it (``build_engine``)
        assert leaf == "_target_" or any(leaf in options for options in ENGINE_OPTIONS.values()), f"{key}: no engine reads it"
    elif "_target_" in {f.name for f in dataclasses.fields(node)}:
        # a component's options are arguments of the callable that ``instantiate`` builds
        assert leaf in INSTANTIATE_KEYS or leaf in _parameters(node._target_), f"{key} is not a parameter of {node._target_}"
    else:
        assert leaf in names_read, f"{key}: nothing in rlexp/ reads it; read it, or refuse it in validate() and list it in REFUSED"


@pytest.mark.parametrize("target", sorted(ENGINE_OPTIONS))
def test_engine_options_are_the_engines_parameters(target):
    """What ``validate`` lets through to an engine is exactly what its constructor takes (beside the policy)."""
    assert set(ENGINE_OPTIONS[target]) == _parameters(target) - {"self", "model", "processor"}


@pytest.mark.parametrize("key", NOT_FOR_TRAINING)
def test_values_training_cannot_run_yet_are_refused_for_it(key, names_read):
    assert key.rpartition(".")[2] in names_read
    with pytest.raises(ConfigError) as error:
        prepare(compose_config(f"{key}={NOT_FOR_TRAINING[key]}"))
    assert "\n" not in str(error.value) and key in str(error.value), str(error.value)


def test_refused_keys_are_not_read(names_read):
    """Once one of them is read, drop its refusal here and in validate()."""
    for key in REFUSED:
        assert key.rpartition(".")[2] not in names_read, f"{key} is read now: drop its refusal"


@pytest.mark.parametrize("key,f", [(k, f) for k, f in schema_leaves() if field_type(f.type) in (int, float)])
def test_every_number_has_a_range(key, f):
    assert "range" in f.metadata, f"{key}: give it a range with ranged(default, '[low, high]')"


def test_schema_has_no_untyped_nodes():
    """Only ``model.lora.target_modules`` (a name or a list of names) may hold any type."""
    untyped = [key for key, f in schema_leaves() if f.type is Any]
    assert untyped == ["model.lora.target_modules"]
