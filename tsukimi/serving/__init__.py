"""Serving, a folder per process: `worker/` (an inference worker behind the internal HTTP API of
`protocol.py`), `prefill_group/` (a CPP prefill group's stages), `router/` (placement over the
workers, with `openai/` its OpenAI-compatible front and `dashboard/` its live view) and
`cluster/` (`tsukimi up`: the plan of processes and their supervisor). `kv_events.py` is the KV
event wire that workers publish and routers subscribe to."""
