"""The target of a transport check in a process of its own (on another emulated host, say),
driven over JSON lines (`JsonWorker`; its parent half is host_pairs.py).

    python -m tsukimi.testing.target_peer METADATA_URL

Replies `{"ok": true, "host_id": ID}` when ready, then serves one command per line:

    {"cmd": "open", "bind_host": H, "nbytes": N}  a Transfer Engine named "target" serving on H
                                                  (addresses, comma-separated: one server each),
                                                  with N bytes of shared memory registered
                                                  -> {"name", "host_id", "buffer": BUFFER}
    {"cmd": "allocate", "nbytes": N}              -> {"buffer": BUFFER}
    {"cmd": "unregister", "base": B}              -> {}
    {"cmd": "notifications", "wait_s": S, "max_count": M | null}
                                                  -> {"notifications": [[name, message hex], ...]}
    {"cmd": "close"}                              the engine closes (its buffers go with it)

BUFFER is {"base", "length", "shm_name"}: the parent maps the same shared-memory file to see
the owner's memory (the machine's hosts share /dev/shm; only their networks are apart).
Errors come back as `{"ok": false, "error": "<ErrorClass>: message"}`; closing stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import sys

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError, TsukimiError
from tsukimi.testing.processes import child_reply
from tsukimi.transfer import RegisteredBuffer, TransferEngine
from tsukimi.transfer.segment import host_id

TARGET_NAME = "target"


def _buffer(buf: RegisteredBuffer) -> dict[str, object]:
    return {"base": buf.base, "length": buf.length, "shm_name": buf.shm_name}


class _Target:
    """At most one open target engine and its commands."""

    def __init__(self, metadata_url: str) -> None:
        self.metadata_url = metadata_url
        self.engine: TransferEngine | None = None

    def handle(self, cmd: dict[str, object]) -> dict[str, object]:
        what = cmd["cmd"]
        if what == "open":
            self.close()
            transfer = TransferConfig(bind_host=str(cmd["bind_host"]))
            self.engine = TransferEngine(TARGET_NAME, Config(transfer, MetadataConfig(url=self.metadata_url)))
            buf = self.engine.allocate(int(str(cmd["nbytes"])))
            return {"name": self.engine.name, "host_id": host_id(), "buffer": _buffer(buf)}
        if what == "close":
            self.close()
            return {}
        engine = self._open()
        if what == "allocate":
            return {"buffer": _buffer(engine.allocate(int(str(cmd["nbytes"]))))}
        if what == "unregister":
            engine.unregister(int(str(cmd["base"])))
            return {}
        if what == "notifications":
            limit = cmd.get("max_count")
            got = engine.notifications(None if limit is None else int(str(limit)), float(str(cmd["wait_s"])))
            return {"notifications": [[n.name, n.message.hex()] for n in got]}
        raise ConfigError(f"unknown command {what!r}")

    def _open(self) -> TransferEngine:
        if self.engine is None:
            raise ConfigError("no target is open: send open first")
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tsukimi.testing.target_peer")
    parser.add_argument("metadata", help="the metadata service's URL (http:// or etcd://)")
    args = parser.parse_args()
    target = _Target(args.metadata)
    child_reply({"host_id": host_id()})
    try:
        for line in sys.stdin:
            try:
                child_reply(target.handle(json.loads(line)))
            except TsukimiError as exc:
                child_reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        target.close()


if __name__ == "__main__":
    main()
