"""Integrations of tsukimi with inference engines (vLLM)."""
