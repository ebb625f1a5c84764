"""vLLM on tsukimi: a KV connector on the store (tsukimi.integrations.vllm.connector), PD disaggregation,
the models, and vLLM instances as the router's workers (backend.py, launch.py)."""
