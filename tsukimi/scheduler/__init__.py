"""The Conductor's side of tsukimi: which KV blocks exist where, and where a request should run.

`block_hash` turns token ids into chained, process-independent block ids; `prefix_index` is
the global index of which cache (instance and tier) holds which blocks. Both are plain
objects with no sockets, threads or clocks, shared by the live servers and the simulator.
"""
