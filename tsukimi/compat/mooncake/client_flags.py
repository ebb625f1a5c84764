"""`mooncake_client`'s command-line flags (gflags syntax, as master_flags.py reads them),
checked and mapped onto a `StoreSetup` for `tsukimi compat mooncake-client`.

A flag tsukimi maps changes the setup; one of Mooncake's with no meaning here (its thread
count, its arena allocator, its HTTP metrics server...) is accepted and named in a warning;
one asking for what tsukimi does not do (per-client offload, tenants) and anything unknown
is a ConfigError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tsukimi.compat.mooncake.master_flags import next_flag
from tsukimi.compat.mooncake.setup_args import StoreSetup, from_args
from tsukimi.errors import ConfigError

PROGRAM = "mooncake_client"
BOOLEANS = frozenset(
    [
        "enable_offload",
        "enable_http_server",
        "start_offload_rpc_server",
        "use_mmap_arena_allocator",
        "logtostderr",
        "alsologtostderr",
    ]
)
IGNORED = frozenset(
    [
        "threads",
        "enable_http_server",
        "http_port",
        "start_offload_rpc_server",
        "mmap_arena_pool_size",
        "use_mmap_arena_allocator",
        "device_names",
        "logtostderr",
        "alsologtostderr",
        "v",
        "minloglevel",
        "log_dir",
    ]
)
MAPPED = frozenset(
    [
        "host",
        "port",
        "master_server_address",
        "metadata_server",
        "global_segment_size",
        "local_buffer_size",
        "protocol",
        "enable_offload",
        "tenant_id",
    ]
)


@dataclass(slots=True)
class ClientFlags:
    """The flags given: the store setup (segment server on `setup.host`), the port dummy
    clients connect to, and the flags accepted without meaning here."""

    setup: StoreSetup
    port: int
    ignored: list[str] = field(default_factory=list)


def parse(argv: Sequence[str]) -> ClientFlags:
    """The flags of `argv`, Mooncake's defaults for the others.

    Raises:
        ConfigError: an unknown flag, a flag without its value, a bad value (naming it).
    """
    values: dict[str, str] = {
        "host": "0.0.0.0",
        "port": "50052",
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "global_segment_size": "4 GB",
        "local_buffer_size": "0",
        "protocol": "tcp",
        "enable_offload": "false",
        "tenant_id": "default",
    }
    ignored: list[str] = []
    args = list(argv)
    while args:
        name, value, args = next_flag(args, BOOLEANS, PROGRAM)
        if name in MAPPED:
            values[name] = value
        elif name in IGNORED:
            ignored.append(name)
        else:
            raise ConfigError(f"unknown {PROGRAM} flag --{name} (tsukimi knows {', '.join(sorted(MAPPED))})")
    if values["enable_offload"].lower() in ("true", "1", "yes", "t", "y"):
        raise ConfigError(f"{PROGRAM} --enable_offload: per-client offload is not supported (the master's is)")
    port = values["port"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{PROGRAM} flag --port={port}: not a port")
    setup = from_args(
        values["host"],
        values["metadata_server"],
        values["global_segment_size"],
        values["local_buffer_size"],
        values["protocol"],
        "",
        values["master_server_address"],
        tenant_id=values["tenant_id"],
    )
    return ClientFlags(setup, int(port), ignored)
