"""The inference engine: the Llama model in torch (model.py), its weights (weights.py) and
tokenizers (tokenizer.py), the paged KV cache (kv_cache.py), sampling, and the engine loop."""
