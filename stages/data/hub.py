"""The Hugging Face hub as the model and dataset sources read it: offline or not, where its cache is, and which
names can be a repo id.

huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE once, when it is imported; these functions read them when
called, so a variable set later (by a user's script, or a test) is honoured. No Prefect, no MLflow.
"""

from __future__ import annotations

import os
from pathlib import Path


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now; unset: huggingface_hub's own default."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """The hub cache that downloads fill and offline reads use: HF_HUB_CACHE as set now, else huggingface_hub's."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()


def is_repo_id(name: str) -> bool:
    """True for a name the hub accepts as a repo id (`org/name`, `name`); False for one no repo can have
    (./x, /x, ~/x, a/b/c, a name with spaces), which is never sent to the hub.

    >>> is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct"), is_repo_id("./models/foo"), is_repo_id("a/b/c")
    (True, False, False)
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
