"""Integrations of tsukimi with other inference engines (vLLM)."""
