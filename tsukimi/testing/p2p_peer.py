"""A P2P store in a child process, driven over JSON lines (`JsonWorker`), for fault tests.

    python -m tsukimi.testing.p2p_peer METADATA_URL [--transport tcp] [--shard-bytes N] [--ttl S]
                                       [--bind-host ADDRESS]   (its segment server's; default 127.0.0.1)

Replies `{"ok": true, "segment": NAME}` when ready, then serves one command per line:

    {"cmd": "register", "name": N, "size": B, "seed": S}   payload bytes from `payload_bytes(B, S)`
    {"cmd": "fetch", "name": N, "size": B}                 get_replica into fresh memory -> sha256
    {"cmd": "corrupt", "name": N, "offset": O}             flip one byte of its copy (no crc update)
    {"cmd": "unregister" | "delete_replica", "name": N}
    {"cmd": "stats"}

Errors come back as `{"ok": false, "error": "<ErrorClass>: message"}`. Closing stdin ends it
(its store withdraws everything); SIGKILL is what the fault tests send.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import fields

import numpy as np

from tsukimi.config import Config, MetadataConfig, P2PConfig, TransferConfig
from tsukimi.errors import TsukimiError
from tsukimi.p2p import P2PStore
from tsukimi.testing.processes import child_reply


def payload_bytes(size: int, seed: int) -> bytearray:
    """The deterministic test payload of `size` bytes for `seed` (parent and child agree)."""
    return bytearray(np.random.default_rng(seed).bytes(size))


def digest(data: bytes | bytearray | memoryview) -> str:
    """sha256 hex of `data`."""
    return hashlib.sha256(data).hexdigest()


def _config(args: argparse.Namespace) -> Config:
    return Config(
        transfer=TransferConfig(transport=args.transport, bind_host=args.bind_host),
        metadata=MetadataConfig(url=args.metadata),
        p2p=P2PConfig(max_shard_bytes=args.shard_bytes, holder_ttl_s=args.ttl, max_inflight=args.inflight),
    )


def _serve(store: P2PStore) -> None:
    held: dict[str, bytearray] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            child_reply(_handle(store, held, cmd))
        except TsukimiError as exc:
            child_reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _handle(store: P2PStore, held: dict[str, bytearray], cmd: dict[str, object]) -> dict[str, object]:
    what, name = cmd["cmd"], str(cmd.get("name", ""))
    if what == "register":
        held[name] = payload_bytes(int(str(cmd["size"])), int(str(cmd["seed"])))
        info = store.register(name, [held[name]])
        return {"shards": len(info.shard_sizes)}
    if what == "fetch":
        held[name] = bytearray(int(str(cmd["size"])))
        store.get_replica(name, [held[name]])
        return {"sha256": digest(held[name]), "stats": _stats(store)}
    if what == "corrupt":
        held[name][int(str(cmd["offset"]))] ^= 0xFF
        return {}
    if what == "unregister":
        store.unregister(name)
        return {}
    if what == "delete_replica":
        store.delete_replica(name)
        return {}
    if what == "stats":
        return {"stats": _stats(store)}
    return {"ok": False, "error": f"unknown command {what!r}"}


def _stats(store: P2PStore) -> dict[str, int]:
    values = {f.name: getattr(store.stats, f.name) for f in fields(store.stats)}
    return {k: v for k, v in values.items() if isinstance(v, int)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tsukimi.testing.p2p_peer")
    parser.add_argument("metadata")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--shard-bytes", type=int, default=1 << 20)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=2)
    parser.add_argument("--bind-host", default="127.0.0.1", help="where its segment server listens")
    args = parser.parse_args()
    with P2PStore(_config(args)) as store:
        child_reply({"segment": store.engine.name})
        _serve(store)


if __name__ == "__main__":
    main()
