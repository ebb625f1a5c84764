"""tsukimi under vLLM: the KV connector, the Conductor routing vLLM instances, launching them."""
