"""Secrets never reach what a run records: tracker params and tags (MLflow on a real server on
127.0.0.1, W&B offline, the run dir's JSON) and the resolved config saved in a checkpoint."""

import json

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from conftest import compose_config
from rlexp.tracking import build_trackers
from rlexp.tracking.secrets import REDACTED, is_secret_key, redact
from rlexp.training.checkpoint import save_checkpoint
from tracking_support import isolate_wandb, wandb_records

SECRETS = {
    "WANDB_API_KEY": "wandb-secret-" + "0123456789" * 4,
    "MLFLOW_TRACKING_PASSWORD": "mlflow-pass-0123456789",
    "MLFLOW_TRACKING_TOKEN": "mlflow-token-0123456789",
    "HF_TOKEN": "hf_secret0123456789",
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE0123456789",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-0123456789",
}


@pytest.mark.parametrize(
    "key",
    ["hf_token", "logger.mlflow.tags.api_token", "x.password", "db_passwd", "client_secret", "wandb.api_key", "apiKey",
     "AWS_SECRET_ACCESS_KEY", "aws_access_key_id", "accessToken", "credentials", "token", "MLFLOW_TRACKING_TOKEN"],
)
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["rollout.max_new_tokens_per_turn", "pad_token_id", "tokens", "key", "monkey", "algorithm.lr", "env.max_steps", "token_count"],
)
def test_ordinary_keys(key):
    assert not is_secret_key(key)


def test_redact_values_by_key_by_environment_and_in_urls(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    tree = {
        "a": {"hf_token": "literal", "lr": 0.1, "none_token": None},
        "uri": "https://user:pw123@mlflow.example.com/x",
        "note": f"key={SECRETS['WANDB_API_KEY']} and {SECRETS['AWS_SECRET_ACCESS_KEY']}",
        "list": [SECRETS["HF_TOKEN"], 3],
    }
    assert redact(tree) == {
        "a": {"hf_token": REDACTED, "lr": 0.1, "none_token": None},
        "uri": f"https://user:{REDACTED}@mlflow.example.com/x",
        "note": f"key={REDACTED} and {REDACTED}",
        "list": [REDACTED, 3],
    }
    assert tree["a"]["hf_token"] == "literal"  # a copy


def test_params_tags_and_checkpoint_config_carry_no_secret(tmp_path, monkeypatch, mlflow_server):
    """Credentials in the environment and interpolated into the config, and secret-named tags on the command
    line, go nowhere a run records."""
    isolate_wandb(monkeypatch, tmp_path)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config(
        "name=secrets", "run_name=r", "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri={mlflow_server.uri}",
        "+logger.mlflow.tags.owner=${oc.env:WANDB_API_KEY}", "+logger.mlflow.tags.hf_token=typed-on-the-command-line",
        "logger.wandb.tags=[${oc.env:HF_TOKEN}]", "logger.wandb.mode=offline", "+extra.aws_secret_access_key=${oc.env:AWS_SECRET_ACCESS_KEY}",
        f"+extra.url=http://me:{SECRETS['MLFLOW_TRACKING_PASSWORD']}@host:5000",
    )
    run_dir = tmp_path / "run"
    trackers = build_trackers(cfg.logger, run_dir, cfg)
    trackers.set_tags({"error": f"failed with token {SECRETS['MLFLOW_TRACKING_TOKEN']}"})
    trackers.finish("FINISHED")

    class Adapter:
        def save_pretrained(self, path):
            path.mkdir(parents=True)
            (path / "adapter_config.json").write_text("{}")
            (path / "adapter_model.safetensors").write_bytes(b"w")

    checkpoint = save_checkpoint(run_dir / "checkpoints", 1, Adapter(), {}, cfg, 1)

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(json.loads((run_dir / "tracking" / "mlflow.json").read_text())["run_id"])
    wandb_config = b"".join(r.SerializeToString() for p in run_dir.glob("wandb/*/run-*.wandb") for r in wandb_records(p))
    recorded = {
        "mlflow params": json.dumps(run.data.params),
        "mlflow tags": json.dumps(run.data.tags),
        "params.json": (run_dir / "params.json").read_text(),
        "tags.json": (run_dir / "tags.json").read_text(),
        "wandb": wandb_config.decode("utf-8", "replace"),
        "checkpoint config.yaml": (checkpoint / "config.yaml").read_text(),
    }
    for where, text in recorded.items():
        for secret in [*SECRETS.values(), "typed-on-the-command-line"]:
            assert secret not in text, f"{secret} in {where}"
    assert run.data.params["extra.aws_secret_access_key"] == REDACTED
    assert run.data.params["logger.mlflow.tags.owner"] == REDACTED
    assert run.data.tags["hf_token"] == REDACTED and run.data.tags["owner"] == REDACTED
    assert run.data.params["extra.url"] == f"http://me:{REDACTED}@host:5000"
    assert run.data.params["rollout.max_new_tokens_per_turn"] == str(cfg.rollout.max_new_tokens_per_turn)
    saved = OmegaConf.load(checkpoint / "config.yaml")
    assert saved.extra.aws_secret_access_key == REDACTED and saved.rollout == cfg.rollout
