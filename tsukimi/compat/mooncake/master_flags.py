"""`mooncake_master`'s command-line flags, read the way gflags reads them, mapped onto
tsukimi's settings (`tsukimi compat mooncake-master`).

gflags accepts `--name=value`, `-name=value`, `--name value`, and for booleans `--name`,
`--noname`, `--name=true|false|1|0|yes|no`. A flag tsukimi maps changes a setting; a flag of
Mooncake's that has no meaning here (its RPC thread count, its snapshot backend, ...) is
accepted and named in one warning; anything else is a ConfigError.

The SSD offload flags map onto the disk tier (`master.offload` and its neighbours) once all
flags are read: no `--enable_offload`: "off"; with `--offload_on_evict`: "on_evict" (copies
made when memory runs short); without: "on_put" (Mooncake's copy at PutEnd).
`--promotion_on_hit` (off by default, as in Mooncake) with `--promotion_admission_threshold`
(default 2), and `--root_fs_dir`, the directory clients keep their disks under.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tsukimi.config import MasterConfig
from tsukimi.errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes", "t", "y"), ("false", "0", "no", "f", "n")


def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def duration_s(text: str) -> float:
    """Mooncake's durations: raw milliseconds, or a number with ms, s, m or h."""
    found = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", text)
    if not found:
        raise ValueError(f"not a duration: {text!r} (milliseconds, or a number with ms, s, m, h)")
    scale = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1e-3}[found.group(2)]
    return float(found.group(1)) * scale


@dataclass(slots=True)
class MasterFlags:
    """What the flags asked for: tsukimi's master settings, the metadata server, the flags
    accepted without meaning here."""

    master: MasterConfig = field(default_factory=MasterConfig)
    metadata_server: bool = False
    metadata_host: str = "0.0.0.0"
    metadata_port: int = 8080
    metrics_host: str = "0.0.0.0"
    offload: dict[str, object] = field(default_factory=dict)  # the SSD offload flags, as given
    ignored: list[str] = field(default_factory=list)


Apply = Callable[[MasterFlags, str], None]


def _master(name: str, convert: Callable[[str], object]) -> Apply:
    def apply(flags: MasterFlags, value: str) -> None:
        changes: dict[str, Any] = {name: convert(value)}
        flags.master = dataclasses.replace(flags.master, **changes)

    return apply


def _attr(name: str, convert: Callable[[str], object]) -> Apply:
    def apply(flags: MasterFlags, value: str) -> None:
        setattr(flags, name, convert(value))

    return apply


def _offload(name: str, convert: Callable[[str], object]) -> Apply:
    def apply(flags: MasterFlags, value: str) -> None:
        flags.offload[name] = convert(value)

    return apply


def _etcd(flags: MasterFlags, value: str) -> None:
    endpoints = ",".join(e.strip() for e in value.split(";") if e.strip())
    flags.master = dataclasses.replace(flags.master, ha_etcd=f"etcd://{endpoints}" if endpoints else "")


MAPPED: dict[str, tuple[Callable[[str], object], Apply]] = {
    "rpc_port": (int, _master("rpc_port", int)),
    "port": (int, _master("rpc_port", int)),
    "rpc_address": (str, _master("host", str)),
    "metrics_port": (int, _master("http_port", int)),
    "metrics_host": (str, _attr("metrics_host", str)),
    "default_kv_lease_ttl": (duration_s, _master("lease_ttl_s", duration_s)),
    "client_ttl": (float, _master("client_ttl_s", float)),
    "put_start_discard_timeout_sec": (float, _master("put_timeout_s", float)),
    "eviction_ratio": (float, _master("evict_ratio", float)),
    "eviction_high_watermark_ratio": (float, _master("high_watermark", float)),
    "enable_http_metadata_server": (_bool, _attr("metadata_server", _bool)),
    "http_metadata_server_host": (str, _attr("metadata_host", str)),
    "http_metadata_server_port": (int, _attr("metadata_port", int)),
    "etcd_endpoints": (str, _etcd),
    "cluster_id": (str, _master("ha_cluster", lambda v: re.sub(r"[^A-Za-z0-9_.-]", "-", v) or "tsukimi")),
    "enable_offload": (_bool, _offload("enable_offload", _bool)),
    "offload_on_evict": (_bool, _offload("offload_on_evict", _bool)),
    "promotion_on_hit": (_bool, _offload("promotion_on_hit", _bool)),
    "root_fs_dir": (str, _offload("root_fs_dir", str)),
    "default_kv_soft_pin_ttl": (duration_s, _master("soft_pin_ttl_s", duration_s)),
    "promotion_admission_threshold": (int, _offload("promotion_admission_threshold", int)),
}
BOOLEANS = frozenset(
    [
        "enable_http_metadata_server",
        "enable_offload",
        "offload_on_evict",
        "promotion_on_hit",
        "enable_ha",
        "enable_cxl",
        "enable_disk_eviction",
        "enable_kv_events",
        "enable_metadata_cleanup_on_timeout",
        "enable_metric_reporting",
        "enable_multi_tenants",
        "enable_oplog",
        "enable_snapshot",
        "enable_snapshot_restore",
        "allow_evict_soft_pinned_objects",
        "kv_events_emit_legacy_compat",
        "kv_events_emit_object_key",
        "offload_force_evict",
        "rpc_enable_tcp_no_delay",
        "logtostderr",
        "alsologtostderr",
    ]
)
# Mooncake's own flags that mean nothing to tsukimi (accepted, named in a warning)
IGNORED = frozenset(
    [
        "allocation_strategy",
        "allow_evict_soft_pinned_objects",
        "batch_oplog_retry_timeout_sec",
        "config_path",
        "cxl_path",
        "cxl_size",
        "dynamic_replication_admission_qps_threshold",
        "dynamic_replication_heat_window_seconds",
        "dynamic_replication_max_memory_replicas",
        "dynamic_replication_mode",
        "enable_cxl",
        "enable_disk_eviction",
        "enable_ha",
        "enable_kv_events",
        "enable_metadata_cleanup_on_timeout",
        "enable_metric_reporting",
        "enable_multi_tenants",
        "enable_oplog",
        "enable_snapshot",
        "enable_snapshot_restore",
        "global_file_segment_size",
        "ha_backend_connstring",
        "ha_backend_type",
        "kv_events_additional_salt",
        "kv_events_backend_id",
        "kv_events_bind_endpoint",
        "kv_events_block_size",
        "kv_events_dp_rank",
        "kv_events_emit_legacy_compat",
        "kv_events_emit_object_key",
        "kv_events_lora_name",
        "kv_events_model_name",
        "kv_events_queue_capacity",
        "kv_events_tenant_id",
        "max_kv_soft_pin_ttl",
        "max_retry_attempts",
        "max_threads",
        "max_total_finished_tasks",
        "max_total_pending_tasks",
        "max_total_processing_tasks",
        "memory_allocator",
        "nof_eviction_high_watermark_ratio",
        "nof_eviction_ratio",
        "nof_heartbeat_failures_threshold",
        "nof_heartbeat_interval_sec",
        "nof_heartbeat_probe_timeout_ms",
        "offload_cap_ratio",
        "offload_force_evict",
        "offloading_queue_limit",
        "oplog_batch_max_entries",
        "oplog_poll_interval_ms",
        "pending_task_timeout_sec",
        "pod_name",
        "pod_namespace",
        "processing_task_timeout_sec",
        "promotion_max_per_heartbeat",
        "promotion_queue_limit",
        "put_start_release_timeout_sec",
        "quota_bytes",
        "rpc_conn_timeout_seconds",
        "rpc_enable_tcp_no_delay",
        "rpc_interface",
        "rpc_thread_num",
        "snapshot_backup_dir",
        "snapshot_catalog_backend_connstring",
        "snapshot_catalog_backend_type",
        "snapshot_catalog_store_connstring",
        "snapshot_catalog_store_type",
        "snapshot_child_timeout_seconds",
        "snapshot_interval_seconds",
        "snapshot_object_store_type",
        "snapshot_payload_backend_type",
        "snapshot_payload_store_type",
        "snapshot_retention_count",
        "tenant_quota_connector_type",
        "tenant_quota_connector_uri",
        "logtostderr",
        "alsologtostderr",
        "v",
        "minloglevel",
        "log_dir",
    ]
)


def parse(argv: Sequence[str]) -> MasterFlags:
    """The flags of `argv` (gflags syntax), applied in order.

    Raises:
        ConfigError: an unknown flag, a flag without its value, or a value of the wrong kind
            (naming the flag).
    """
    flags, args = MasterFlags(), list(argv)
    while args:
        name, value, args = _next(args)
        if name in MAPPED:
            try:
                MAPPED[name][1](flags, value)
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"mooncake_master flag --{name}={value}: {exc}") from exc
        elif name in IGNORED:
            flags.ignored.append(name)
        else:
            raise ConfigError(f"unknown mooncake_master flag --{name} (tsukimi knows {', '.join(sorted(MAPPED))})")
    _apply_offload(flags)
    return flags


def _apply_offload(flags: MasterFlags) -> None:
    """The SSD offload flags as the disk tier's settings (see the module). Raises ConfigError."""
    given = flags.offload
    mode = "off" if not given.get("enable_offload") else "on_evict" if given.get("offload_on_evict") else "on_put"
    changes: dict[str, Any] = {
        "offload": mode,
        "promotion_on_hit": bool(given.get("promotion_on_hit", False)),
        "promotion_admission_threshold": given.get("promotion_admission_threshold", 2),
        "disk_root": str(given.get("root_fs_dir", "")),
    }
    try:
        flags.master = dataclasses.replace(flags.master, **changes)
    except ConfigError as exc:
        raise ConfigError(f"mooncake_master offload flags {given}: {exc}") from exc


def _next(args: list[str]) -> tuple[str, str, list[str]]:
    return next_flag(args, BOOLEANS, "mooncake_master")


def next_flag(args: list[str], booleans: frozenset[str], program: str) -> tuple[str, str, list[str]]:
    """One gflags flag off the front of `args`: (name, value, the rest); `booleans` are the
    flags that may go without a value. Raises ConfigError naming `program`."""
    head, rest = args[0], args[1:]
    if not head.startswith("-"):
        raise ConfigError(f"{program} takes flags only, got {head!r}")
    body = head.lstrip("-")
    name, eq, value = body.partition("=")
    boolean = name in booleans or (name.startswith("no") and name[2:] in booleans)
    if eq:
        return name, value, rest
    if boolean:
        return (name[2:], "false", rest) if name not in booleans else (name, "true", rest)
    if not rest:
        raise ConfigError(f"{program} flag --{name} needs a value")
    return name, rest[0], rest[1:]
