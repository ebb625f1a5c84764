"""tsukimi: a Python implementation of Mooncake's KVCache-centric disaggregated LLM serving platform."""

__version__ = "0.1.0"
