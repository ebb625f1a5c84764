"""Worker processes of `tsukimi bench p2p`, driven by line-delimited JSON on stdin/stdout
(tsukimi/testing/processes.py). Every process exits when its stdin closes.

Roles (`python -m tsukimi.bench.child p2p-worker ROLE ARGS_JSON`, tsukimi/bench/child.py):
  origin    holds the checkpoint in plain process memory, registered with a Transfer Engine;
            ready: {"name", "base", "crcs"}; "publish"/"withdraw" a P2P payload over it.
  receiver  a Transfer Engine and a zeroed (faulted-in) buffer of the checkpoint's size;
            "go": pull the checkpoint (system "naive": READs of the origin's buffer, shard by
            shard, `inflight` shards at a time; "tsukimi": `P2PStore.get_replica`), reply
            {"start", "done", "cpu_s", "origin_bytes", "replica_bytes", "transport"}, and tsukimi's
            `P2PStats` thread-seconds {"read_s", "announce_s", "idle_s"}; "verify": compare
            each shard's crc32c with the origin's.
  gloo      one rank of a `torch.distributed` gloo group (rank 0 holds the checkpoint);
            "init" joins the group; "go": barrier, then one `broadcast` per shard from rank 0;
            rank 0 also reports the bytes its process wrote (`/proc/self/io` wchar).
Times are `time.monotonic()` (CLOCK_MONOTONIC: one clock for every process of the machine,
emulated hosts included); "cpu_s" is the process's CPU time (all threads) during the pull.
Argument "bind_host" (default 127.0.0.1): where the Transfer Engine serves (the lab bench: the
emulated host's address).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import crc32c
import numpy as np

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import TransferError
from tsukimi.p2p import P2PStore
from tsukimi.testing.processes import child_reply
from tsukimi.transfer import Batch, OpCode, TransferEngine, TransferRequest

_PATTERN_BYTES = 1 << 20
_GOLDEN = 0x9E3779B97F4A7C15


def checkpoint(nbytes: int, seed: int) -> np.ndarray:
    """`nbytes` of deterministic bytes: a random 1 MiB block XORed with a different word in
    every 1 MiB chunk (fast to make, and a shard landing at the wrong offset changes its crc)."""
    words = np.random.default_rng(seed).integers(0, 1 << 63, _PATTERN_BYTES // 8, dtype=np.uint64)
    out = np.empty(nbytes, np.uint8)
    for i, off in enumerate(range(0, nbytes, _PATTERN_BYTES)):
        n = min(_PATTERN_BYTES, nbytes - off)
        chunk = np.bitwise_xor(words, np.uint64((i * _GOLDEN) & ((1 << 64) - 1))).view(np.uint8)
        out[off : off + n] = chunk[:n]
    return out


def shard_ranges(nbytes: int, shard_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each shard."""
    return [(off, min(shard_bytes, nbytes - off)) for off in range(0, nbytes, shard_bytes)]


def shard_crcs(buf: np.ndarray, shard_bytes: int) -> list[int]:
    return [crc32c.crc32c(buf[off : off + n].data) for off, n in shard_ranges(len(buf), shard_bytes)]


def verify_reply(buf: np.ndarray, shard_bytes: int, expected: list[int]) -> dict[str, object]:
    """Which shards' crc32c differ from the origin's (`expected`)."""
    got = shard_crcs(buf, shard_bytes)
    bad = [i for i in range(max(len(got), len(expected))) if got[i : i + 1] != expected[i : i + 1]]
    return {"verified": not bad, "bad_shards": bad}


def _commands() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def _config(args: dict[str, Any]) -> Config:
    transfer = TransferConfig(transport=args["transport"], bind_host=args.get("bind_host", "127.0.0.1"))
    return Config(transfer=transfer, metadata=MetadataConfig(url=args["metadata_url"]))


def _engine(config: Config, role: str) -> TransferEngine:
    return TransferEngine(f"bench-p2p-{role}-{os.getpid()}", config)


def run_origin(args: dict[str, Any]) -> None:
    buf = checkpoint(args["checkpoint_bytes"], args["seed"])
    config = _config(args)
    with _engine(config, "origin") as engine, P2PStore(config, engine=engine) as store:
        base = engine.register(buf)
        child_reply({"name": engine.name, "base": base, "crcs": shard_crcs(buf, args["shard_bytes"])})
        for cmd in _commands():
            if cmd["cmd"] == "publish":
                store.register(cmd["payload"], [buf], max_shard_bytes=args["shard_bytes"])
            elif cmd["cmd"] == "withdraw":
                store.unregister(cmd["payload"])
            child_reply({})


def pull_naive(engine: TransferEngine, cmd: dict[str, Any], local: np.ndarray, args: dict[str, Any]) -> str:
    """READ the origin's buffer shard by shard, `inflight` shards at a time; the transport used."""
    handle = engine.open_segment(cmd["origin"])
    pending: deque[Batch] = deque()

    def finish(batch: Batch) -> None:
        bad = [s for s in batch.wait() if s.state.value != "completed"]
        if bad:
            raise TransferError(f"shard read failed: {bad[0]}")

    for off, n in shard_ranges(len(local), args["shard_bytes"]):
        if len(pending) >= args["inflight"]:
            finish(pending.popleft())
        request = TransferRequest(OpCode.READ, handle, cmd["base"] + off, local[off : off + n])
        pending.append(engine.submit([request], timeout_s=args["timeout_s"]))
    while pending:
        finish(pending.popleft())
    return engine.transport_for(handle, cmd["base"])


def run_receiver(args: dict[str, Any]) -> None:
    local = np.empty(args["checkpoint_bytes"], np.uint8)
    local.fill(0)  # NOTE: fault the pages in now, so that no system pays for them while timed
    config = _config(args)
    with _engine(config, "receiver") as engine:
        store = P2PStore(config, engine=engine) if args["system"] == "tsukimi" else None
        child_reply({"name": engine.name})
        for cmd in _commands():
            if cmd["cmd"] == "verify":
                child_reply(verify_reply(local, args["shard_bytes"], cmd["crcs"]))
                continue
            if cmd["cmd"] == "close":  # NOTE: withdraw this replica now, while the driver waits
                if store is not None:
                    store.close()
                    store = None
                child_reply({})
                continue
            start, cpu = time.monotonic(), time.process_time()
            spent: dict[str, float] = {}
            if store is None:
                transport = pull_naive(engine, cmd, local, args)
                done, from_origin, from_replicas = time.monotonic(), len(local), 0
            else:
                store.get_replica(cmd["payload"], [local])
                done, stats = time.monotonic(), store.stats
                from_origin, from_replicas = stats.bytes_from_gold, stats.bytes_from_replicas
                spent = {"read_s": stats.read_s, "announce_s": stats.announce_s, "idle_s": stats.idle_s}
                transport = engine.transport_for(cmd["origin"], cmd["base"])
            cpu_s = time.process_time() - cpu
            reply = {"origin_bytes": from_origin, "replica_bytes": from_replicas, "transport": transport, **spent}
            child_reply({"start": start, "done": done, "cpu_s": cpu_s, **reply})
        if store is not None:
            store.close()


def _written_bytes() -> int:
    """Bytes this process passed to write-like syscalls (all its threads), `/proc/self/io`."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def run_gloo(args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, shard_bytes = args["rank"], args["shard_bytes"]
    if rank == 0:
        tensor = torch.from_numpy(checkpoint(args["checkpoint_bytes"], args["seed"]))
    else:
        tensor = torch.empty(args["checkpoint_bytes"], dtype=torch.uint8)
        tensor.zero_()  # NOTE: faulted in, as the Transfer Engine receivers' buffers
    child_reply({"crcs": shard_crcs(tensor.numpy(), shard_bytes) if rank == 0 else []})
    for cmd in _commands():
        if cmd["cmd"] == "init":
            dist.init_process_group(
                "gloo",
                init_method=args["init_method"],
                rank=rank,
                world_size=args["world_size"],
                timeout=datetime.timedelta(seconds=args["timeout_s"]),
            )
            child_reply({})
        elif cmd["cmd"] == "go":
            dist.barrier()
            start, cpu, written = time.monotonic(), time.process_time(), _written_bytes()
            for off, n in shard_ranges(len(tensor), shard_bytes):
                dist.broadcast(tensor[off : off + n], src=0)
            done, cpu_s = time.monotonic(), time.process_time() - cpu
            child_reply({"start": start, "done": done, "cpu_s": cpu_s, "written_bytes": _written_bytes() - written})
        elif cmd["cmd"] == "verify":
            child_reply(verify_reply(tensor.numpy(), shard_bytes, cmd["crcs"]))
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """Run the role `argv[0]` with the JSON arguments `argv[1]` until stdin closes."""
    roles = {"origin": run_origin, "receiver": run_receiver, "gloo": run_gloo}
    if len(argv) != 2 or argv[0] not in roles:
        raise SystemExit(f"usage: python -m tsukimi.bench.child p2p-worker {{{','.join(roles)}}} ARGS_JSON")
    try:
        roles[argv[0]](json.loads(argv[1]))
    except Exception as exc:  # NOTE: the driver quotes it (and the stderr tail) in its error
        child_reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        raise
