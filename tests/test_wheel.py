"""A non-editable install works: a wheel of this checkout, installed into a fresh venv, starts and
trains from a working dir outside the checkout (its config groups and pinned mazes are package data).

The build uses what is installed (``--no-build-isolation``, no network); the venv sees the installed
dependencies (``--system-site-packages``) but gets rlexp only from the wheel (``--no-deps``).
"""

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from test_documented_commands import TINY

#: what a source tree needs to build; build outputs, runs and caches are left behind.
NOT_SOURCE = shutil.ignore_patterns(".git", "outputs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv*")


def sh(*args, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A venv with the wheel of this checkout installed; returns its ``bin/``."""
    pytest.importorskip("setuptools", reason="building the wheel without network needs setuptools installed")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy, so that the build's build/ and *.egg-info stay out of the checkout
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_SOURCE)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", tmp / "dist", source, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("rlexp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    conf_files = {p.relative_to(REPO).as_posix() for p in (REPO / "rlexp" / "conf").rglob("*.yaml")}
    assert conf_files <= set(names), f"missing from the wheel: {sorted(conf_files - set(names))}"
    assert "rlexp/envs/data/maze_easy_pinned.json" in names and "rlexp/envs/data/maze_hard_pinned.json" in names

    sh(sys.executable, "-m", "venv", "--system-site-packages", tmp / "venv", cwd=tmp)
    bin_dir = tmp / "venv" / "bin"
    if sys.prefix != sys.base_prefix:  # the suite runs in a venv: the new one sees that venv's packages too
        site_dir = sh(bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp).stdout.strip()
        Path(site_dir, "outer-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    sh(bin_dir / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel, cwd=tmp)
    return bin_dir


def user_env() -> dict[str, str]:
    """The test session's environment (tiny-model cache, MLflow store in tmp) without anything that
    would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env.pop("MLFLOW_TRACKING_URI", None)  # the default store, <cwd>/outputs/mlflow.db
    return env


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(wheel_venv, tmp_path):
    env = user_env()
    where = sh(wheel_venv / "python", "-c", "import rlexp, rlexp.cli; print(rlexp.__file__); print(rlexp.cli.CONF_DIR)", cwd=tmp_path, env=env)
    module_file, conf_dir = map(Path, where.stdout.split())
    venv = wheel_venv.parent.resolve()
    assert module_file.resolve().is_relative_to(venv), f"rlexp imported from {module_file}, not the wheel in {venv}"
    assert conf_dir.resolve().is_relative_to(venv) and (conf_dir / "config.yaml").is_file()

    composed = sh(wheel_venv / "rlexp", "--cfg", "job", cwd=tmp_path, env=env)
    assert "task: train" in composed.stdout and "model:" in composed.stdout

    sh(wheel_venv / "rlexp", *TINY, "run_name=from-wheel", cwd=tmp_path, env=env)
    run_dir = tmp_path / "outputs" / "tiny_cpu" / "from-wheel"
    summary = json.loads((run_dir / "eval" / "step_000001.summary.json").read_text())
    assert summary["num_mazes"] == 2 and summary["turn_limit"] == 2
    assert (run_dir / "checkpoints" / "global_step_1" / "manifest.json").is_file()
    assert (tmp_path / "outputs" / "mlflow.db").is_file()
