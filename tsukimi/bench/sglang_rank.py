"""One SGLang rank of `tsukimi bench sglang` (bench/sglang.py), run in `.venv-sglang`:

    python -m tsukimi.bench.child sglang-rank SPEC_JSON

It makes SGLang's own storage backend the way SGLang's cache controller does
(`StorageBackendFactory.create_backend`): "mooncake" (SGLang's MooncakeStore over whatever
`mooncake.store` is: the real wheel, or tsukimi's facade under `tsukimi compat exec`) or
"dynamic" (tsukimi's TsukimiHiCacheStorage), over an MHA host pool (SGLang's
`MHATokenToKVPoolHost`, page_first, only the fields its `get_page_buffer_meta` reads set) of
`pages` pages of PAGE_BYTES (k + v), filled with random bytes.

It replies once when ready, then runs one op per command line (`{"cmd": "set" | "exists" |
"get", "round": N}`; round N's keys are its own) over all pages in calls of `batch` pages
(SGLang's STORAGE_BATCH_SIZE) and replies
`{"seconds", "pages_ok"}`; "get" zeroes the pool first (untimed) and adds `exact`: whether
the pages read back equal those written. Speaks JSON lines on a private duplicate of stdout
(mooncake_cluster.protocol_stream), so what the C++ library prints cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tsukimi.bench.mooncake_cluster import protocol_stream
from tsukimi.bench.mooncake_te import MOONCAKE_ENV
from tsukimi.testing.processes import child_reply

logger = logging.getLogger(__name__)

PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM, DTYPE_BYTES = 16, 8, 4, 32, 2
PAGE_BYTES = 2 * PAGE_TOKENS * LAYERS * HEADS * HEAD_DIM * DTYPE_BYTES  # k + v: 64 KiB


def host_pool(pages: int) -> Any:
    """SGLang's MHA host pool class holding `pages` pages of random bytes."""
    import torch
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    pool = object.__new__(MHATokenToKVPoolHost)  # NOTE: its own __init__ wants a device pool
    size = pages * PAGE_TOKENS
    pool.kv_buffer = torch.empty(2, size, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    pool.page_size, pool.size, pool.layer_num, pool.head_num, pool.head_dim = PAGE_TOKENS, size, LAYERS, HEADS, HEAD_DIM
    pool.v_head_dim, pool.dtype, pool.layout = HEAD_DIM, torch.bfloat16, "page_first"
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(size)))
    return pool


def storage(spec: dict[str, Any], pool: Any) -> Any:
    """The backend `spec["backend"]` names, made by SGLang's factory and given the pool."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=spec["tp_rank"],
        tp_size=spec["tp_size"],
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/model",
        extra_config=spec["extra_config"],
    )
    backend = StorageBackendFactory.create_backend(spec["backend"], config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def run_op(op: str, backend: Any, pool: Any, keys: list[str], batch: int) -> dict[str, Any]:
    """Time `op` over every page in calls of `batch`; the reply. Raises KeyError: unknown op."""
    import torch

    calls: dict[str, Callable[[list[str], Any], int]] = {
        "set": lambda k, idx: sum(backend.batch_set_v1(k, idx)),
        "get": lambda k, idx: sum(backend.batch_get_v1(k, idx)),
        "exists": lambda k, idx: int(backend.batch_exists(k)),
    }
    call = calls[op]
    before = ""
    if op == "get":
        before = _hex(pool)
        pool.kv_buffer.view(torch.uint8).zero_()
    ok = 0
    started = time.perf_counter()
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        indices = torch.arange(start * PAGE_TOKENS, (start + len(chunk)) * PAGE_TOKENS, dtype=torch.int64)
        ok += call(chunk, indices)
    reply: dict[str, Any] = {"seconds": time.perf_counter() - started, "pages_ok": ok}
    if op == "get":
        reply["exact"] = _hex(pool) == before
    return reply


def _hex(pool: Any) -> str:
    import torch

    return hashlib.blake2b(pool.kv_buffer.view(torch.uint8).numpy().tobytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """`SPEC_JSON`: run one rank until stdin closes (see the module)."""
    spec = json.loads((argv or sys.argv[1:])[0])
    for name, value in MOONCAKE_ENV.items():
        os.environ.setdefault(name, value)  # NOTE: read by the real wheel's engine during setup()
    logging.basicConfig(level=logging.WARNING)
    proto = protocol_stream()
    try:
        pool = host_pool(spec["pages"])
        backend = storage(spec, pool)
    except Exception as exc:  # NOTE: the parent quotes it; the traceback goes to stderr
        logger.exception("rank setup failed")
        child_reply({"ok": False, "error": f"setup: {exc}"}, out=proto)
        return 1
    child_reply({"tp_rank": spec["tp_rank"]}, out=proto)
    for line in sys.stdin:
        command = json.loads(line)
        keys = [f"{spec['key_prefix']}-r{command.get('round', 0)}-{i}" for i in range(spec["pages"])]
        child_reply(run_op(command["cmd"], backend, pool, keys, spec["batch"]), out=proto)
    proto.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: the wheel's background threads may hang interpreter teardown
