"""`tsukimi p2p ...`: publish, fetch and list P2P payloads from the shell.

    tsukimi p2p publish FILE --name N --metadata URL   serve FILE (mapped, no copy) until Ctrl-C
    tsukimi p2p fetch N --out FILE --metadata URL      pull it; --seed: keep serving afterwards
    tsukimi p2p ls [PREFIX] --metadata URL             payloads, sizes, live copies per shard

The metadata URL (http://.../metadata of `tsukimi metadata-server`, or etcd://...) can also
come from `--config` / `--set metadata.url=...`; the cluster secret from [security] or
TSUKIMI_CLUSTER_SECRET, as for every other command.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from rich.console import Console
from rich.table import Table

from tsukimi.config import Config, load
from tsukimi.errors import ConfigError
from tsukimi.p2p.store import P2PStore
from tsukimi.p2p.weights import fetch_to_file, publish_file


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `tsukimi p2p` on the CLI's subparsers (mutates `sub`)."""
    p2p = sub.add_parser("p2p", help="the P2P store: publish, fetch and list payloads").add_subparsers(
        dest="p2p", required=True
    )
    publish = p2p.add_parser("publish", help="serve a file as a P2P payload until interrupted")
    publish.add_argument("file", help="the file (mapped, never written)")
    publish.add_argument("--name", required=True, help="the payload's name")
    publish.add_argument("--shard-bytes", type=int, default=None, help="shard size (default p2p.max_shard_bytes)")
    fetch = p2p.add_parser("fetch", help="pull a P2P payload into a file")
    fetch.add_argument("name", help="the payload's name")
    fetch.add_argument("--out", required=True, help="the file to write (created or truncated)")
    fetch.add_argument("--seed", action="store_true", help="keep serving the copy until interrupted")
    ls = p2p.add_parser("ls", help="list P2P payloads")
    ls.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    for cmd in (publish, fetch, ls):
        cmd.add_argument("--metadata", default="", help="metadata URL: http://HOST:PORT/metadata or etcd://...")
        cmd.add_argument("--config", help="a TOML file (sections: transfer, metadata, security, p2p)")
        cmd.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run `tsukimi p2p ...`; the exit status. Raises TsukimiError (ConfigError, PayloadNotFound...)."""
    overrides = list(args.set)
    if args.metadata:
        overrides.append(f'metadata.url="{args.metadata}"')
    config = load(Config, args.config, overrides)
    if config.metadata.url == "p2p":
        raise ConfigError("tsukimi p2p needs a metadata service: --metadata http://HOST:PORT/metadata or etcd://...")
    with P2PStore(config) as store:
        if args.p2p == "publish":
            info = publish_file(store, args.name, args.file, args.shard_bytes)
            console.print(
                f"published {info.name}: {info.total_bytes} bytes in {len(info.shard_sizes)} shards "
                f"from {store.engine.name}; serving until interrupted",
                highlight=False,
                soft_wrap=True,
            )
            _wait_for_signal()
        elif args.p2p == "fetch":
            started = time.perf_counter()
            info = fetch_to_file(store, args.name, args.out, keep_replica=args.seed)
            seconds = time.perf_counter() - started
            stats = store.stats
            console.print(
                f"fetched {info.name} -> {args.out}: {info.total_bytes} bytes in {seconds:.2f} s "
                f"({info.total_bytes / seconds / 1e9:.2f} GB/s; {stats.bytes_from_gold} from the origin, "
                f"{stats.bytes_from_replicas} from other holders, {stats.retries} retries)",
                highlight=False,
                soft_wrap=True,
            )
            if args.seed:
                console.print("seeding until interrupted", highlight=False, soft_wrap=True)
                _wait_for_signal()
        else:
            console.print(_table(store, args.prefix))
    return 0


def _table(store: P2PStore, prefix: str) -> Table:
    table = Table("name", "bytes", "shards", "copies (min..max)")
    for info in store.list(prefix):
        counts = info.replica_counts or [0]
        table.add_row(info.name, str(info.total_bytes), str(len(info.shard_sizes)), f"{min(counts)}..{max(counts)}")
    return table


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
