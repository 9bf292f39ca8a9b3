import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from rlexp.cli import CONF_DIR

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="session")
def _isolated_state(tmp_path_factory):
    """Runs the tests start (in-process or as subprocesses) write nothing into the checkout: the tiny
    model's cache (unless the caller set one) and the default MLflow store live in the session's tmp."""
    os.environ.setdefault("RLEXP_CACHE", str(tmp_path_factory.mktemp("rlexp-cache")))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def compose_config(*overrides: str):
    """The composed config for these overrides, as ``rlexp`` would build it (without running a task)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="session")
def tiny_processor():
    from rlexp.models import load_processor, resolve_model_path

    return load_processor(resolve_model_path("tiny"))


@pytest.fixture(scope="session")
def tiny_policy():
    """The tiny Qwen3-VL with a fresh LoRA adapter, and its processor (shared: tests must not train it)."""
    from rlexp.models import apply_lora, load_model_and_processor, resolve_model_path

    model, processor = load_model_and_processor(resolve_model_path("tiny"))
    return apply_lora(model, 8, 16, 0.0, "all-linear-language"), processor


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 for the tests of one module, stopped after them."""
    from tracking_support import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()
