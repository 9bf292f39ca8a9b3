"""The layout rule: recipes (``rlexp/tasks``) import components; components never import recipes, and
import each other only downwards in one order, so that no two packages depend on each other."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "rlexp"
#: component packages (and top-level modules), lowest first: each may import only those before it.
LAYERS = [
    ["runtime"],
    ["envs", "algorithms", "tracking"],
    ["config"],
    ["models"],
    ["planning"],
    ["rollout"],
    ["evaluation"],
    ["training"],
    ["cluster"],
]
#: what may import anything: the recipes, and the entrypoint that dispatches to them.
TOP = {"tasks", "cli", "__main__", "__init__", "ray_job"}


def _unit(path: Path) -> str:
    """The package (or top-level module) a source file belongs to: rlexp/training/loop.py -> training."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_units(path: Path) -> set[str]:
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rlexp" and len(parts) > 1:
                units.add(parts[1])
    return units


def _rank(unit: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if unit in layer:
            return rank
    raise AssertionError(f"rlexp/{unit} is in no layer of tests/test_layout.py: place it in LAYERS or TOP")


def test_components_never_import_recipes_and_only_import_downwards():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        if unit in TOP:
            continue
        for imported in _imported_units(path) - {unit}:
            if imported in TOP:
                problems.append(f"{path.relative_to(REPO)} (a component) imports the recipe layer rlexp.{imported}")
            elif _rank(imported) >= _rank(unit):
                problems.append(f"{path.relative_to(REPO)} ({unit}) imports rlexp.{imported}, which is not below it")
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_component_importing_a_recipe(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rlexp.tasks.train_grpo import GRPOStep\nimport rlexp.training.loop\n")
    assert _imported_units(bad) == {"tasks", "training"}
