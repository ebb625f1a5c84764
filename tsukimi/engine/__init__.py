"""The inference engine: the Llama model in torch (model.py), its weights (weights.py) and
tokenizers (tokenizer.py), the paged KV cache (kv_cache.py), sampling, and the engine loop
(engine.py: schedule -> run -> postprocess over scheduler.py, block_manager.py and
model_runner.py; request.py holds the per-request record); the KV pool connector (kv_pool.py)."""
