"""`HiCacheSettings`: tsukimi's HiCache backend settings, read from SGLang's
`--hicache-storage-backend-extra-config` JSON (the dynamic backend's extra_config).

Keys (all optional but the dynamic factory's own; unknown keys are a ConfigError):

    backend_name, module_path, class_name   the factory's (`dynamic` loads the class by them)
    interface_v1    SGLang's own: 1 makes its cache controller call batch_get_v1 / batch_set_v1
                    (zero-copy into the host pool; without it, the generic path's batch_get /
                    batch_set of one flat tensor per page); also SGLang's tp_lcm_size,
                    enable_metadata_cache, metadata_ttl (read by SGLang, ignored here)
    master          the store master's RPC endpoint                       "tcp://127.0.0.1:50051"
    metadata        Transfer Engine metadata ("p2p", "http://HOST:PORT/metadata", ...)  "p2p"
    transport       "auto", "shm", "cma" or "tcp"                                     "auto"
    segment_bytes   memory this rank adds to the pool (0: a pure client)               0
    rpc_timeout_s   deadline of every master call; transfers get 5x (at least 5 s)     2.0
    replicas        replicas per page                                                   1
    local_first     a page's first replica goes to this rank's own segment when it has    true
                    room (each TP rank reads back its own pages: then a memcpy, no transfer;
                    the master places it elsewhere when that segment is full or absent)
    model_tag       the model part of every key (default: SGLang's model name)         ""
    checksum        crc32c every object                                              false
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from tsukimi.config import Config
from tsukimi.errors import ConfigError
from tsukimi.integrations.vllm.config import TsukimiConnectorConfig

FACTORY_KEYS = ("backend_name", "module_path", "class_name")
SGLANG_KEYS = ("interface_v1", "tp_lcm_size", "enable_metadata_cache", "metadata_ttl")


@dataclass(frozen=True, slots=True)
class HiCacheSettings:
    """The backend's settings (see the module docstring for each key)."""

    master: str = "tcp://127.0.0.1:50051"
    metadata: str = "p2p"
    transport: str = "auto"
    segment_bytes: int = 0
    rpc_timeout_s: float = 2.0
    replicas: int = 1
    local_first: bool = True
    model_tag: str = ""
    checksum: bool = False

    def __post_init__(self) -> None:
        if self.rpc_timeout_s <= 0 or self.segment_bytes < 0 or self.replicas < 1:
            raise ConfigError("rpc_timeout_s must be > 0, segment_bytes >= 0, replicas >= 1")

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> HiCacheSettings:
        """Parse the extra_config dict.

        Raises:
            ConfigError: an unknown key, or a value of the wrong type.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - set(FACTORY_KEYS) - set(SGLANG_KEYS))
        if unknown:
            raise ConfigError(f"unknown hicache extra_config keys {unknown}; valid: {sorted(known)}")
        defaults = cls()
        values: dict[str, object] = {}
        for key in sorted(set(extra) & known):
            value, kind = extra[key], type(getattr(defaults, key))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ConfigError(f"hicache extra_config[{key!r}] must be {kind.__name__}, got {value!r}")
            values[key] = value
        return replace(defaults, **values)  # type: ignore[arg-type]

    def tsukimi_config(self) -> Config:
        """The tsukimi Config of the backend's store client: every master call bounded by
        `rpc_timeout_s`, every transfer by 5x that (at least 5 s): the vLLM connector's mapping
        (integrations/vllm/config.py), so both plug-ins time out alike."""
        return TsukimiConnectorConfig(
            master=self.master,
            metadata=self.metadata,
            transport=self.transport,
            segment_bytes=self.segment_bytes,
            rpc_timeout_s=self.rpc_timeout_s,
            checksum=self.checksum,
        ).tsukimi_config()
