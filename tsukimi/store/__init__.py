"""Mooncake Store in Python: master (metadata), client (moves bytes with the Transfer Engine)."""
