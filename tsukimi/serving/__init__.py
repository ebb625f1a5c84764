"""Serving: inference workers behind an internal HTTP API (worker.py), the OpenAI-compatible
router in front of them (openai_api.py, router.py), and `tsukimi up`, which starts a whole
local cluster as processes and supervises it (cluster.py)."""
