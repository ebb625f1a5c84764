"""What the master's HTTP endpoints report, as Mooncake's master does: a one-line summary
(`/metrics/summary`), the keys page by page (`/get_all_keys`) and several keys' replicas at
once (`/batch_query_keys`). Pure functions of a `MasterState` (the server holds its lock).
"""

from __future__ import annotations

from dataclasses import dataclass

from tsukimi.store.master.state import MasterState
from tsukimi.store.protocol import MAX_BATCH

MAX_KEYS_PAGE = 1_000_000
_MB = 1 << 20


def _size(num_bytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", _MB), ("KB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


@dataclass(frozen=True, slots=True)
class TierRates:
    """The holders' throughput of the disk tier's copies, averaged over every copy made."""

    offload_bytes_per_s: float
    promotion_bytes_per_s: float


def tier_rates(state: MasterState) -> TierRates:
    """Bytes copied per second of holder time, to disk and back (pure)."""
    c = state.counters
    offload_s, promotion_s = c["offload_us"] / 1e6, c["promotion_us"] / 1e6
    return TierRates(
        c["offloaded_bytes"] / offload_s if offload_s else 0.0,
        c["promoted_bytes"] / promotion_s if promotion_s else 0.0,
    )


def summary(state: MasterState, role: str) -> str:
    """Mooncake's `/metrics/summary` line: memory and disk use, keys, clients, the tiers (pure)."""
    registry, disks, c = state.registry, state.tiers.registry.disks.values(), state.counters
    used, capacity = registry.used, registry.capacity
    disk_used, disk_capacity = sum(d.used for d in disks), sum(d.capacity for d in disks)
    soft = sum(1 for r in state.objects.values() if r.config.soft_pin)
    on_disk = sum(1 for r in state.objects.values() if r.disks)
    rates = tier_rates(state)
    return (
        f"role={role}, state=serving, master={{Mem Storage: {_size(used)} / {_size(capacity)}"
        f" ({100 * used / capacity if capacity else 0:.1f}%) | SSD Storage: {_size(disk_used)} / "
        f"{_size(disk_capacity)} ({len(state.tiers.registry.disks)} disks) | Keys: {len(state.objects)}"
        f" (soft-pinned: {soft}, on disk: {on_disk}) | Clients: {len(registry.clients)} | Requests: hits "
        f"{c['hits']}, misses {c['misses']}, puts {c['puts_completed']}, removes {c['removes']} | Eviction: "
        f"{c['evictions']} evicted, {c['memory_freed_to_disk']} freed to disk, {c['disk_evictions']} off disk"
        f" | Offload: {c['offloads']} ({_size(c['offloaded_bytes'])}, {rates.offload_bytes_per_s / _MB:.1f} MB/s)"
        f" | Promotion: {c['promotions']} ({_size(c['promoted_bytes'])}, "
        f"{rates.promotion_bytes_per_s / _MB:.1f} MB/s)}}"
    )


def all_keys(state: MasterState, start_after: str = "", limit: int = MAX_KEYS_PAGE) -> tuple[list[str], str]:
    """Up to `limit` complete keys after `start_after`, in order, and the key to start the
    next page after ("" when this is the last page) (pure)."""
    keys = sorted(k for k in state.objects if k > start_after)
    page = keys[: max(0, min(limit, MAX_KEYS_PAGE))]
    return page, page[-1] if len(keys) > len(page) and page else ""


def batch_query(state: MasterState, keys: list[str]) -> dict[str, dict[str, object]]:
    """Each key's replicas in Mooncake's shape (`values`: memory, `local_disk_values`: disk
    copies), plus `group_id` / `session_id` where the object has them; keys beyond MAX_BATCH
    are left out (pure)."""
    out: dict[str, dict[str, object]] = {}
    now = state.clock.now()
    for key in keys[:MAX_BATCH]:
        record = state.objects.get(key)
        if record is None:
            out[key] = {
                "ok": False,
                "error": "OBJECT_NOT_FOUND",
                "values": None,
                "disk_values": None,
                "local_disk_values": None,
                "nof_values": None,
            }
            continue
        info = state.describe(key)
        values = [
            {"size_": r.size, "buffer_address_": r.address, "protocol_": "tcp", "transport_endpoint_": r.te_segment}
            for r in info.replicas
        ]
        disk = [
            {"size_": d.size, "transport_endpoint_": d.endpoint, "disk_id": d.disk_id, "put_id": d.put_id}
            for d in state.tiers.locations(record, now)
        ]
        out[key] = {
            "ok": True,
            "error": None,
            "values": values or None,
            "disk_values": None,
            "local_disk_values": disk or None,
            "nof_values": None,
        }
        # NOTE: tsukimi's additions, only when set: the replica group and the writer's session
        extras = {"group_id": info.group, "session_id": info.session}
        out[key].update({name: value for name, value in extras.items() if value})
    return out
