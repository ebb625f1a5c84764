"""`mooncake.mooncake_config`: the configuration Mooncake's scripts, examples and connectors
load (`MooncakeConfig.load_from_env()`, `MooncakeConfig.from_file(path)`), with the wheel's
rules (0.3.13.post1), so that code written against it runs unchanged on tsukimi.

    MOONCAKE_CONFIG_PATH                  a JSON file (from_file); else the variables below
    MOONCAKE_MASTER                       master_server_address (required without a file)
    MOONCAKE_LOCAL_HOSTNAME               local_hostname            "localhost"
    MOONCAKE_TE_META_DATA_SERVER          metadata_server           "P2PHANDSHAKE"
    MOONCAKE_GLOBAL_SEGMENT_SIZE          global_segment_size       3355443200 (3.125 GiB)
    MOONCAKE_LOCAL_BUFFER_SIZE            local_buffer_size         1073741824 (1 GiB)
    MOONCAKE_PROTOCOL / MOONCAKE_DEVICE   protocol, device_name     "tcp", ""
    MOONCAKE_OFFLOAD_ENABLED              enable_ssd_offload        false
    MOONCAKE_OFFLOAD_FILE_STORAGE_PATH    ssd_offload_path          ""
    MOONCAKE_TENANT_ID                    tenant_id                 "default"
    MOONCAKE_ENABLE_CLIENT_HTTP_SERVER    enable_client_http_server false
    MOONCAKE_CLIENT_HTTP_PORT             client_http_port          9300

Sizes are bytes or a number with a 1024-based suffix (b, k/kb, m/mb, g/gb, t/tb, any case,
fractions allowed: "1.5gb"); booleans true/1/yes/on/enable or false/0/no/off/disable (empty:
false). Bad values raise ValueError, as the wheel's do. The protocol is lower-cased; one the
wheel does not know is passed on with a warning (tsukimi's setup then refuses what it cannot
serve, with its own error).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3_355_443_200  # 3.125 GiB
DEFAULT_LOCAL_BUFFER_SIZE = 1_073_741_824  # 1 GiB
DEFAULT_CLIENT_HTTP_PORT = 9300
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE, _FALSE = ("true", "1", "yes", "on", "enable"), ("false", "0", "no", "off", "disable")
_PROTOCOLS = frozenset(
    [
        "tcp",
        "rdma",
        "efa",
        "nvmeof",
        "nvlink",
        "musa",
        "nvlink_intra",
        "hip",
        "barex",
        "cxl",
        "ascend",
        "ub",
        "ubshmem",
        "maca",
        "sunrise_link",
        "rpc_only",
    ]
)


def parse_size(value: object) -> int:
    """Bytes from an int or a size string ("4gb", "1.5 G", "4096"). Raises ValueError."""
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(str(value)) if not isinstance(value, float) else int(value)
    text = value.strip().lower()
    if not text:
        raise ValueError("Invalid segment size: empty string")
    number, unit = text, 1
    for suffix in ("kb", "mb", "gb", "tb", "k", "m", "g", "t", "b"):
        if text.endswith(suffix):
            number, unit = text[: -len(suffix)].strip(), _UNITS[suffix[0]]
            if not number:
                raise ValueError(f"Invalid segment size: missing number before {suffix!r}")
            break
    return int(float(number) * unit)


def parse_bool(value: object) -> bool:
    """A boolean from a bool, a number or text (see the module). Raises ValueError."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value)
    text = "" if value is None else str(value).strip().lower()
    if text in ("", *_FALSE):
        return False
    if text in _TRUE:
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """A Mooncake client's configuration (the fields of `store.setup`; see the module)."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = DEFAULT_CLIENT_HTTP_PORT

    def __post_init__(self) -> None:
        """Normalise the protocol and check the invariants. Raises ValueError."""
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}: it must be a non-empty string, e.g. 'tcp'")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _PROTOCOLS:
            logger.warning("unrecognised protocol %r: passed on unchanged", self.protocol)
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}: a size must be non-negative")
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {value!r}")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """The configuration in a JSON file. Raises ValueError (a missing required field, a
        bad value), OSError, json.JSONDecodeError."""
        with open(file_path, encoding="utf-8") as source:
            config = json.load(source)
        missing = [name for name in _REQUIRED if name not in config]
        if missing:
            raise ValueError(f"Missing required config field: {missing[0]}")
        offload_path, tenant = config.get("ssd_offload_path"), config.get("tenant_id")
        return MooncakeConfig(
            local_hostname=config["local_hostname"],
            metadata_server=config["metadata_server"],
            global_segment_size=parse_size(config.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=parse_size(config.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=config.get("protocol", "tcp"),
            device_name=config.get("device_name", ""),
            master_server_address=config["master_server_address"],
            enable_ssd_offload=parse_bool(config.get("enable_ssd_offload", False)),
            ssd_offload_path="" if offload_path is None else str(offload_path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=parse_bool(config.get("enable_client_http_server", False)),
            client_http_port=int(config.get("client_http_port", DEFAULT_CLIENT_HTTP_PORT)),
        )

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """The file `MOONCAKE_CONFIG_PATH` names, else the variables of the module. Raises
        ValueError (neither `MOONCAKE_CONFIG_PATH` nor `MOONCAKE_MASTER`, or a bad value)."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor 'MOONCAKE_MASTER' is set.")
        return MooncakeConfig(
            local_hostname=os.getenv("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=os.getenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=parse_size(os.getenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=parse_size(os.getenv("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=os.getenv("MOONCAKE_PROTOCOL", "tcp"),
            device_name=os.getenv("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=parse_bool(os.getenv("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=os.getenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=os.getenv("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=parse_bool(os.getenv("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(os.getenv("MOONCAKE_CLIENT_HTTP_PORT", str(DEFAULT_CLIENT_HTTP_PORT))),
        )
