"""The arguments of `MooncakeDistributedStore.setup`, checked and turned into tsukimi's
settings: the positional form (up to Mooncake 0.3.13's thirteen arguments) and the
dictionary form, whose sizes may be written "16MB", "1.5 GB", "512 KB" or plain bytes.

    setup("localhost", "http://h:8080/metadata", 3200 << 20, 512 << 20, "tcp", "", "h:50051")
    setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
           "global_segment_size": "16MB", "master_server_addr": "h:50051"})
    setup(config={...})

`bind` picks the form as the wheel's pybind11 overloads do: a dictionary, alone, positionally
or as `config=`, is the dictionary form; anything else binds the arguments by name, and a
call that binds neither is a TypeError.

`local_hostname` names this client's Transfer Engine segment, as in Mooncake: "host:port"
binds its segment server there; a bare "host" picks a free port in 12300..14300. Every
problem is a ConfigError naming the argument (the store answers INVALID_PARAMS).
"""

from __future__ import annotations

import errno
import inspect
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tsukimi.compat.mooncake import offload
from tsukimi.compat.mooncake.rdma import rdma_uses_nixl
from tsukimi.config import ClientConfig, Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError
from tsukimi.store.client import StoreClient
from tsukimi.transfer import TransferEngine

DEFAULT_SIZE = 16 << 20
MAX_SIZE = 1 << 40
MIN_SEGMENT = 1024
PORT_RANGE = (12300, 14300)
PORT_TRIES = 32
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")
DICT_KEYS = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "ipc_socket_path",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)


@dataclass(frozen=True, slots=True)
class StoreSetup:
    """A checked setup: where this client's segment server binds (`port` 0: pick one in
    PORT_RANGE), the memory it contributes and may stage copies in, and where the master is."""

    host: str
    port: int
    metadata_url: str
    global_segment_size: int
    local_buffer_size: int
    master: str
    transport: str = "auto"
    nixl: bool = False
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""

    def config(self, port: int, ssd_dir: str = "", ssd_bytes: int = 0) -> Config:
        """tsukimi's settings for a client whose segment server binds `port` (and whose disk,
        if any, is `ssd_dir`)."""
        client = ClientConfig(self.master, self.global_segment_size, ssd_dir=ssd_dir, ssd_bytes=ssd_bytes)
        return Config(
            transfer=TransferConfig(transport=self.transport, bind_host=self.host, port=port, nixl=self.nixl),
            metadata=MetadataConfig(url=self.metadata_url),
            client=client,
        )


def connect(setup: StoreSetup, engine: TransferEngine | None = None) -> StoreClient:
    """A store client for `setup`, its segment server bound to setup.port, or to a free port
    of PORT_RANGE (`engine`, when given, is used as it is). Raises what StoreClient raises;
    ConfigError when PORT_TRIES ports of the range were taken."""
    disk: tuple[str, int] = ("", 0)
    if setup.global_segment_size:  # NOTE: a master that offloads gives a holder a disk too (offload.py)
        root = offload.disk_root(setup.master, setup.enable_ssd_offload, setup.ssd_offload_path)
        disk = offload.free_slot(root) if root else disk
    if engine is not None:
        return StoreClient(setup.config(0, *disk), engine)
    ports = [setup.port] if setup.port else random.sample(range(*PORT_RANGE), PORT_TRIES)
    for port in ports:
        try:
            return StoreClient(setup.config(port, *disk))
        except OSError as exc:
            if setup.port or exc.errno != errno.EADDRINUSE:
                raise
    raise ConfigError(f"no free port for the segment server among {PORT_TRIES} tried in {PORT_RANGE}")


def parse_size(name: str, value: object) -> int:
    """Bytes from an int or a size string ("16MB", "1.5 GB", "4096"). Raises ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{name} must be a number of bytes or a size like '16MB', got {value!r}")
    if isinstance(value, str):
        found = _SIZE.fullmatch(value)
        unit = found.group(2).upper() if found else ""
        if found is None or unit not in _UNITS:
            raise ConfigError(f"{name}: {value!r} is not a size (bytes, or a number with B, KB, MB, GB or TB)")
        value = int(float(found.group(1)) * _UNITS[unit])
    if not 0 <= value <= MAX_SIZE:
        raise ConfigError(f"{name} must be in 0..1 TB, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class SetupCall:
    """One `setup(...)` call bound to a form: the dictionary (`config`), or the arguments by
    name (`arguments`: from_args's), with the engine to share (None: own one)."""

    config: Mapping[str, object] | None
    arguments: Mapping[str, object]
    engine: object = None

    def parse(self) -> StoreSetup:
        """The checked setup. Raises ConfigError."""
        if self.config is not None:
            return from_dict(self.config)
        return from_args(**self.arguments)  # type: ignore[arg-type]

    @property
    def client_http_server(self) -> bool:
        """Whether the call asks for Mooncake's client HTTP server."""
        return bool((self.config or self.arguments).get("enable_client_http_server", False))


def bind(args: tuple[object, ...], kwargs: Mapping[str, object]) -> SetupCall:
    """Bind `setup(*args, **kwargs)` to one of Mooncake's two forms (see the module).

    Args:
        args: the positional arguments, self aside.
        kwargs: the keyword arguments.

    Returns:
        The bound call (its values still unchecked: SetupCall.parse checks them).

    Raises:
        TypeError: neither form binds the call, or a dictionary comes with other arguments.
    """
    try:
        config = _CONFIG_FORM.bind(*args, **kwargs).arguments["config"]
    except TypeError:
        config = None
    if isinstance(config, Mapping):
        return SetupCall(config, {})
    try:
        bound = _ARGS_FORM.bind(*args, **kwargs)
    except TypeError as exc:
        forms = "setup(local_hostname, metadata_server, global_segment_size, ...) and setup(config)"
        raise TypeError(f"setup(): {exc}; the forms are {forms}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if isinstance(arguments["local_hostname"], Mapping):
        raise TypeError("setup(config) takes the dictionary alone")
    engine = arguments.pop("engine", None)
    return SetupCall(None, arguments, engine)


def _args_form() -> inspect.Signature:
    """Mooncake's first form: from_args's parameters with `engine` after master_server_addr,
    as in the wheel (a missing metadata_server binds, and is from_args's ConfigError)."""
    params = [
        p.replace(default=None) if p.name == "metadata_server" else p
        for p in inspect.signature(from_args).parameters.values()
    ]
    at = [p.name for p in params].index("master_server_addr") + 1
    params.insert(at, inspect.Parameter("engine", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None))
    return inspect.Signature(params)


def _config_form(config: Mapping[str, object]) -> None:
    """Mooncake's second form (its signature only)."""


def from_dict(config: Mapping[str, object]) -> StoreSetup:
    """The dictionary form. Raises ConfigError (an unknown key among them, naming the known ones)."""
    unknown = sorted(set(config) - set(DICT_KEYS))
    if unknown:
        raise ConfigError(f"unknown setup keys {unknown}; Mooncake's are {', '.join(DICT_KEYS)}")
    for required in ("local_hostname", "metadata_server"):
        if required not in config:
            raise ConfigError(f"setup needs {required!r}")
    args = {k: v for k, v in config.items() if k != "ipc_socket_path"}  # NOTE: no IPC socket here
    return from_args(**args)  # type: ignore[arg-type]


def from_args(
    local_hostname: str,
    metadata_server: str,
    global_segment_size: object = DEFAULT_SIZE,
    local_buffer_size: object = DEFAULT_SIZE,
    protocol: str = "tcp",
    rdma_devices: str = "",
    master_server_addr: str = "127.0.0.1:50051",
    enable_ssd_offload: bool = False,
    ssd_offload_path: str = "",
    tenant_id: str = "default",
    enable_client_http_server: bool = False,
    client_http_port: int = 9300,
) -> StoreSetup:
    """The positional / keyword form (the engine aside). Raises ConfigError."""
    for name, value in (
        ("local_hostname", local_hostname),
        ("metadata_server", metadata_server),
        ("protocol", protocol),
        ("rdma_devices", rdma_devices),
        ("master_server_addr", master_server_addr),
        ("ssd_offload_path", ssd_offload_path),
        ("tenant_id", tenant_id),
    ):
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a str, got {value!r}")
    if tenant_id != "default":
        raise ConfigError(f"tenants are not supported (tenant_id {tenant_id!r}; only 'default')")
    if not isinstance(client_http_port, int) or not 0 < client_http_port < 65536:
        raise ConfigError(f"client_http_port must be a port, got {client_http_port!r}")
    segment = parse_size("global_segment_size", global_segment_size)
    if 0 < segment < MIN_SEGMENT:
        raise ConfigError(f"global_segment_size must be 0 or at least {MIN_SEGMENT} bytes, got {segment}")
    host, port = _host_port("local_hostname", local_hostname, port_optional=True)
    transport, nixl = _protocol(protocol)
    return StoreSetup(
        host,
        port,
        _metadata_url(metadata_server),
        segment,
        parse_size("local_buffer_size", local_buffer_size),
        master_url(master_server_addr),
        transport,
        nixl,
        bool(enable_ssd_offload),
        ssd_offload_path,
    )


def master_url(address: str) -> str:
    """tsukimi's master address for Mooncake's "host:port" (or an etcd:// HA group)."""
    if address.startswith("etcd://"):
        return address.replace(";", ",")
    host, port = _host_port("master_server_addr", address, port_optional=False)
    return f"tcp://{host}:{port}"


def _metadata_url(server: str) -> str:
    if server.upper() in ("P2PHANDSHAKE", ""):
        return "p2p"
    if server.startswith(("http://", "etcd://")):
        return server
    if re.fullmatch(r"[\w.-]+:\d+", server):  # NOTE: Mooncake reads a bare host:port as etcd
        return f"etcd://{server}"
    raise ConfigError(f"metadata_server must be P2PHANDSHAKE, http://..., etcd://... or host:port, got {server!r}")


def _protocol(protocol: str) -> tuple[str, bool]:
    """(transfer.transport, transfer.nixl): "tcp" lets tsukimi pick per peer (shared memory
    on this host, TCP elsewhere); "rdma" adds the NIXL transport (RDMA NICs) where NIXL is
    installed, else it is tcp (rdma.py: one warning)."""
    if protocol == "tcp":
        return "auto", False
    if protocol == "rdma":
        return "auto", rdma_uses_nixl()
    raise ConfigError(f"protocol must be tcp or rdma, got {protocol!r}")


def _host_port(name: str, text: str, port_optional: bool) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep and port_optional:
        host, port = text, "0"
    if not host or not port.isdigit() or not 0 <= int(port) < 65536 or (int(port) == 0 and not port_optional):
        raise ConfigError(f"{name} must be host:port{' or host' if port_optional else ''}, got {text!r}")
    return host.strip("[]"), int(port)


_ARGS_FORM = _args_form()
_CONFIG_FORM = inspect.signature(_config_form)
