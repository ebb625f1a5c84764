"""The worker process: one engine thread behind the internal HTTP API (`tsukimi worker`)."""
