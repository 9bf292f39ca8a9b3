"""Keep credentials out of what a run records: tracker params and tags, and the resolved config saved in
each checkpoint.

A value is replaced by ``***`` when its key names a secret (its last dotted part has the word ``token``
— not ``tokens`` or ``token_id`` —, ``password``, ``secret``, ``credentials``, or ``api``/``access``/
``private`` + ``key``), and inside any value, the value of a credential variable of this process's
environment (``WANDB_API_KEY``, ``MLFLOW_TRACKING_PASSWORD``/``TOKEN``, ``HF_TOKEN``, AWS keys: a secret
interpolated with ``${oc.env:…}`` under an innocent key) and the password of a URL
(``http://user:***@host``) are replaced.
"""

import os
import re
from typing import Any

REDACTED = "***"
#: credentials this process may hold in its environment; their values never appear in a record.
SECRET_ENV_VARS = (
    "WANDB_API_KEY",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)
_SECRET_WORDS = {"password", "passwd", "secret", "credentials", "apikey"}
_KEY_QUALIFIERS = {"api", "access", "private", "secret"}
#: ``token`` followed by one of these counts or names tokens (``pad_token_id``), and holds no secret.
_NOT_SECRET_AFTER_TOKEN = {"id", "ids", "type", "count", "len", "length", "limit", "budget"}
_URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+@")
#: shorter environment values are not searched for (a stray "1" would redact every number).
_MIN_SECRET_LENGTH = 6


def is_secret_key(key: str) -> bool:
    """Whether the last dotted part of ``key`` names a secret (``logger.mlflow.tags.hf_token``: yes;
    ``rollout.max_new_tokens_per_turn``: no)."""
    last = key.rsplit(".", 1)[-1]
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", last).lower())
    for i, word in enumerate(words):
        after = words[i + 1] if i + 1 < len(words) else None
        if word in _SECRET_WORDS or (word == "token" and after not in _NOT_SECRET_AFTER_TOKEN):
            return True
        if word == "key" and i > 0 and words[i - 1] in _KEY_QUALIFIERS:
            return True
    return last.upper() in SECRET_ENV_VARS


def redact_text(text: str) -> str:
    """``text`` without the environment's credential values and URL passwords."""
    for name in SECRET_ENV_VARS:
        value = os.environ.get(name)
        if value and len(value) >= _MIN_SECRET_LENGTH:
            text = text.replace(value, REDACTED)
    return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", text)


def redact(tree: Any, key: str = "") -> Any:
    """A copy of ``tree`` (dicts, lists, scalars: a flat params dict or a whole config) with secrets replaced."""
    if isinstance(tree, dict):
        return {k: REDACTED if is_secret_key(str(k)) and v is not None else redact(v, str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(redact(v, key) for v in tree)
    if isinstance(tree, str):
        return redact_text(tree)
    return tree
