"""Where the worker keeps converted models, kernels, digests and (unless told otherwise) caches."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    if explicit := os.environ.get("LM_WORKER_DATA_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "lm-worker"
