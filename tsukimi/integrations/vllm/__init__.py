"""vLLM on tsukimi: a KV connector on the store (tsukimi.integrations.vllm.connector), PD disaggregation,
the models, and the Conductor routing vLLM instances (backend.py, proxy.py, launch.py)."""
