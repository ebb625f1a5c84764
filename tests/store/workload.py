"""A store workload client for chaos tests, run as its own process.

    python -m tests.store.workload --master URL --out FILE --seconds S --seed N
        [--keys K] [--value-bytes B] [--replicas R] [--set section.key=value ...]

A mixed put (upsert) / get / remove loop over its own keys (`w<seed>-<i>`). The value of a
key's version v is `value_of(key, v, size)`, so any reader can check it byte for byte;
versions only grow. Each operation appends one JSON line to FILE, flushed and fsynced before
the next one starts, so a line means "acknowledged" even if the process is SIGKILLed:

    {"op": "put"|"remove"|"get", "key", "version", "ok": true, "elapsed_s"}
    {"op", "key", "version", "error": class name, "retriable": bool, "ambiguous": bool, "elapsed_s"}

A failed op is `ambiguous` when it may still have been applied (a lost reply).
    {"op": "get", "key", "mismatch": true, "elapsed_s"}        (bytes of no possible version)

A get's version is what it read (null: a miss). On SIGTERM (or after S seconds) it finishes
the operation in progress and appends {"op": "summary", ...}.

    python -m tests.store.workload put-start-and-hang --master URL --key K --bytes B [--replicas R]

A client that heartbeats, sends a raw PutStart, prints "started [replicas as JSON]" and sleeps
until killed: the put is never ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import TextIO

import msgspec

from tsukimi.config import Config, load
from tsukimi.errors import (
    BrokenConnectionError,
    InvalidArgument,
    LeaseHeld,
    ObjectExists,
    ObjectNotFound,
    OutOfSpace,
    PeerError,
    RpcTimeout,
    TransferError,
    TsukimiError,
)
from tsukimi.rpc import RpcClient
from tsukimi.store import protocol as p
from tsukimi.store.client import StoreClient
from tsukimi.store.protocol import CODEC

RETRIABLE = (TransferError, RpcTimeout, PeerError, BrokenConnectionError, OutOfSpace, LeaseHeld)
# NOTE: a put that failed with these never reached PutEnd (or a remove never applied); any
# other failure (a lost reply) is ambiguous: the operation may have been applied.
NOT_APPLIED = (TransferError, OutOfSpace, LeaseHeld, ObjectExists, ObjectNotFound, InvalidArgument)
OPS = ("put", "get", "remove")
OP_WEIGHTS = (4, 5, 1)


def value_of(key: str, version: int, size: int) -> bytes:
    """The bytes of `key` at `version`: deterministic, different for every (key, version)."""
    return random.Random(f"{key}#{version}").randbytes(size)


class _Record:
    """The append-only record of acknowledged operations (one fsynced JSON line each)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, **fields: object) -> None:
        self._out.write(json.dumps(fields) + "\n")
        self._out.flush()
        os.fsync(self._out.fileno())


class Workload:
    """One client's loop. `possible[key]`: the versions the key may hold (None: absent);
    more than one after a failed (ambiguous) put or remove."""

    def __init__(self, client: StoreClient, args: argparse.Namespace, record: _Record) -> None:
        self.client, self.args, self.record = client, args, record
        self.rng = random.Random(args.seed)
        self.keys = [f"w{args.seed}-{i}" for i in range(args.keys)]
        self.possible: dict[str, set[int | None]] = {key: {None} for key in self.keys}
        self.next_version = 1
        self.pending_version: int | None = None  # the version the operation in progress writes
        self.counts: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            op = self.rng.choices(OPS, OP_WEIGHTS)[0]
            key = self.rng.choice(self.keys)
            started = time.monotonic()
            try:
                outcome = getattr(self, f"_{op}")(key)
            except TsukimiError as exc:
                self._failed(op, key, exc, started)
            else:
                self._count(outcome)
                self.record.write(op=op, key=key, **outcome, elapsed_s=round(time.monotonic() - started, 4))
        self.record.write(op="summary", counts=self.counts, stopped=self.stop.is_set())

    def _put(self, key: str) -> dict[str, object]:
        version, self.next_version = self.next_version, self.next_version + 1
        self.pending_version = version
        self.client.put(key, value_of(key, version, self.args.value_bytes), self.args.replicas, upsert=True)
        self.possible[key] = {version}
        return {"version": version, "ok": True}

    def _remove(self, key: str) -> dict[str, object]:
        self.pending_version = None
        self.client.remove(key)  # False (absent) is fine: it is absent either way
        self.possible[key] = {None}
        return {"version": None, "ok": True}

    def _get(self, key: str) -> dict[str, object]:
        self.pending_version = None
        data = self.client.get(key)
        if data is None:
            if None not in self.possible[key]:
                return {"version": None, "ok": True, "lost": True}  # a holder died with its replicas
            return {"version": None, "ok": True}
        for version in self.possible[key]:
            if version is not None and data == value_of(key, version, self.args.value_bytes):
                self.possible[key] = {version}
                return {"version": version, "ok": True}
        return {"mismatch": True}

    def _failed(self, op: str, key: str, exc: TsukimiError, started: float) -> None:
        ambiguous = op != "get" and not isinstance(exc, NOT_APPLIED)
        if ambiguous:
            self.possible[key].add(self.pending_version)
        self.counts[f"{op}_error"] = self.counts.get(f"{op}_error", 0) + 1
        elapsed = round(time.monotonic() - started, 4)
        self.record.write(
            op=op,
            key=key,
            version=self.pending_version,
            error=type(exc).__name__,
            retriable=isinstance(exc, RETRIABLE),
            ambiguous=ambiguous,
            elapsed_s=elapsed,
        )

    def _count(self, outcome: dict[str, object]) -> None:
        name = "mismatch" if outcome.get("mismatch") else "lost" if outcome.get("lost") else "ok"
        self.counts[name] = self.counts.get(name, 0) + 1


def _config(master: str, settings: list[str]) -> Config:
    config = load(Config, None, settings)
    return replace(config, client=replace(config.client, master=master))


def run_workload(args: argparse.Namespace) -> None:
    with open(args.out, "a") as out, StoreClient(_config(args.master, args.set)) as client:
        workload = Workload(client, args, _Record(out))
        signal.signal(signal.SIGTERM, lambda *_: workload.stop.set())
        print("workload ready", flush=True)
        workload.run(args.seconds)


def put_start_and_hang(args: argparse.Namespace) -> None:
    """A live client (it heartbeats) with a put started and never ended; killed by the test."""
    config = _config(args.master, args.set)
    with StoreClient(config) as client, RpcClient(CODEC, args.master) as rpc:
        replicas = p.ReplicaConfig(replicas=args.replicas)
        started = rpc.call_as(p.PutStart(client.client_id, args.key, args.bytes, replicas), p.PutStartResult)
        print("started", json.dumps(msgspec.to_builtins(started.replicas)), flush=True)
        threading.Event().wait()


def main(argv: list[str]) -> None:
    if argv[:1] == ["put-start-and-hang"]:
        hang = argparse.ArgumentParser(prog="workload put-start-and-hang")
        hang.add_argument("--master", required=True)
        hang.add_argument("--key", required=True)
        hang.add_argument("--bytes", type=int, required=True)
        hang.add_argument("--replicas", type=int, default=1)
        hang.add_argument("--set", action="append", default=[])
        put_start_and_hang(hang.parse_args(argv[1:]))
        return
    parser = argparse.ArgumentParser(prog="workload")
    parser.add_argument("--master", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--keys", type=int, default=32)
    parser.add_argument("--value-bytes", type=int, default=65536)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    run_workload(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
