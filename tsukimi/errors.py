"""The one error hierarchy of the whole package.

Errors are named for whose fault they are (after trio and redis-py): the caller's
(`ConfigError`, `InvalidBufferError`, `OutOfBounds`), our own code's (`ClosedError`), the
other side's or the network's (`PeerError`, `BrokenConnectionError`, `RpcTimeout`,
`ProtocolError`, `WorkerError`), or nobody's (`Rejected`: the Conductor chose to turn a request
away). Expected outcomes such as a cache miss are return values, not errors.

Every error has a stable `code` so that it can cross the wire as (code, message) and be
raised again as the same class on the other side (`error_from_code`).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class TsukimiError(Exception):
    """Root of every error raised by tsukimi."""

    code = "tsukimi"


class ConfigError(TsukimiError, ValueError):
    """A configuration value or argument is invalid (the caller's fault)."""

    code = "config"


class InvalidBufferError(TsukimiError, TypeError):
    """A buffer cannot be registered or used (not writable, not contiguous, overlapping)."""

    code = "invalid_buffer"


class ClosedError(TsukimiError):
    """The object was closed by this process and can no longer be used."""

    code = "closed"


class PeerError(TsukimiError):
    """The other side reported a failure or misbehaved."""

    code = "peer"


class BrokenConnectionError(PeerError):
    """The connection to a peer failed; the `OSError` is chained as the cause."""

    code = "broken_connection"


class RpcTimeout(TsukimiError, builtins.TimeoutError):
    """A remote call or transfer did not finish within its deadline."""

    code = "timeout"


class ProtocolError(PeerError):
    """Bytes from the network do not follow the protocol (bad magic, oversized, malformed)."""

    code = "protocol"


class SegmentNotFound(TsukimiError, LookupError):
    """No segment of that name is published in the metadata service or reachable."""

    code = "segment_not_found"


class OutOfBounds(TsukimiError, IndexError):
    """A range falls outside every registered buffer of the target segment."""

    code = "out_of_bounds"


class MetadataError(PeerError):
    """The metadata service failed or answered something unexpected."""

    code = "metadata"


class TransferError(TsukimiError):
    """One or more requests of a synchronous transfer failed; `reasons` says why each."""

    code = "transfer"

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or []


class InvalidArgument(TsukimiError, ValueError):
    """An argument of a call is invalid (bad key, size, replica count): the caller's fault.
    `param`: the request field at fault, where one is (the OpenAI API's error body names it;
    it stays on this side: the wire carries (code, message) only)."""

    code = "invalid_argument"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ObjectNotFound(TsukimiError, KeyError):
    """No complete object of that key exists (for calls where a miss is an error)."""

    code = "object_not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequest(InvalidArgument):
    """A request with this id is already running here (HTTP 409): the caller reused an id."""

    code = "duplicate_request"


class ObjectExists(TsukimiError):
    """An object of that key exists or is being written; use upsert to replace it."""

    code = "object_exists"


class OutOfSpace(TsukimiError):
    """No segment has room for the object, even after evicting what may be evicted."""

    code = "out_of_space"


class OffloadPending(OutOfSpace):
    """No room yet: what eviction may free is still being copied to disk; retry shortly."""

    code = "offload_pending"


class LeaseHeld(TsukimiError):
    """The object is leased to readers; removing it needs force."""

    code = "lease_held"


class TaskNotFound(ObjectNotFound):
    """No copy or move task of that id is known to the master (never created, forgotten, or
    created under an earlier master)."""

    code = "task_not_found"


class TaskInFlight(TsukimiError):
    """The object already has a copy or move task in flight: wait for it to end."""

    code = "task_in_flight"


class KVFormatError(TsukimiError):
    """A KV block in the pool was written in another format (model, dtype, layout)."""

    code = "kv_format"


class ModelNotFound(InvalidArgument):
    """The request names a model this server does not serve (HTTP 404)."""

    code = "model_not_found"


class WorkerError(PeerError):
    """A worker failed, stalled past the read timeout, or answered something malformed (HTTP 502)."""

    code = "worker_error"


class WorkerUnavailable(WorkerError):
    """No worker could take the request: unreachable, refusing with 503, or all marked down (HTTP 503)."""

    code = "worker_unavailable"


class AuthError(PeerError):
    """A peer failed the cluster-secret handshake (or one side has a secret and the other not).

    Raised on the side that tried to connect; the side that refused touched nothing."""

    code = "auth"


class NotLeader(PeerError):
    """This master is not the leader (a standby, or a leader that lost its etcd lease): ask
    the current leader. Retriable: a client given an etcd:// master finds it by itself."""

    code = "not_leader"


class Recovering(NotLeader):
    """A newly elected leader has not yet heard from the holders it restored (they heartbeat
    within client_ttl): retriable, like NotLeader."""

    code = "recovering"


class MasterUnavailable(PeerError):
    """No master leader answered within the client's failover bound (`client.failover_timeout_s`)."""

    code = "master_unavailable"


class ChecksumMismatch(TransferError):
    """The bytes read do not match the crc32c stored with the object (every replica was tried)."""

    code = "checksum"


class RevisionConflict(TsukimiError):
    """A compare-and-set on metadata lost a race: the key changed (or appeared, or vanished)
    since the caller read it. Read it again and retry; nobody's fault."""

    code = "revision_conflict"


class PayloadNotFound(ObjectNotFound):
    """No P2P payload of that name is registered (never, or its origin unregistered it)."""

    code = "payload_not_found"


class PayloadExists(ObjectExists):
    """This P2P store already has that payload open (registered or replicated here)."""

    code = "payload_exists"


class PayloadNotOpen(InvalidArgument):
    """This P2P store has no payload of that name open: nothing to unregister or delete."""

    code = "payload_not_open"


class OverlappingBuffers(InvalidBufferError):
    """Two of the buffers given for one payload share memory."""

    code = "overlapping_buffers"


class TooManyRetries(TransferError):
    """A P2P shard failed from every holder tried (up to max(3, holders) attempts); `reasons`
    lists each attempt's error."""

    code = "too_many_retries"


class DeviceError(TsukimiError):
    """A device (a GPU) or its driver failed a call: a copy, an IPC handle, pinning host memory.
    The message carries the driver's own error name."""

    code = "device"


_REJECTED_PREFIX = "rejected by the Conductor: "


class Rejected(TsukimiError):
    """The Conductor turned the request away (an SLO could not be met; HTTP 429); `reason` says
    which (a short code), `detail` what was predicted, in words."""

    code = "rejected"

    def __init__(self, reason: str, detail: str = "") -> None:
        # NOTE: error_from_code passes the message back in; strip the prefix (and split off the
        # detail, the words after the reason) so that it round-trips
        reason = reason.removeprefix(_REJECTED_PREFIX)
        if not detail and ": " in reason:
            reason, detail = reason.split(": ", 1)
        super().__init__(f"{_REJECTED_PREFIX}{reason}" + (f": {detail}" if detail else ""))
        self.reason, self.detail = reason, detail


def _all_subclasses(cls: type[TsukimiError]) -> list[type[TsukimiError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_from_code(code: str, message: str) -> TsukimiError:
    """Rebuild the error a peer sent as (code, message); unknown codes give `PeerError`."""
    for cls in _all_subclasses(TsukimiError):
        if cls.code == code:
            return cls(message)
    return PeerError(f"[{code}] {message}")


class ErrorTable(Generic[T]):
    """Errors mapped onto another code space (HTTP statuses, Mooncake's return codes): rows of
    (class, value), the first class the error is an instance of wins, `default` when none is.

    Built once at import; a row that an earlier row's base class shadows (it could never be
    chosen) is a ConfigError at construction, so subclasses must come before their bases. Pure.
    """

    def __init__(self, rows: Sequence[tuple[type[BaseException], T]], default: T) -> None:
        for i, (cls, _) in enumerate(rows):
            shadow = next((earlier for earlier, _ in rows[:i] if issubclass(cls, earlier)), None)
            if shadow is not None:
                raise ConfigError(f"{cls.__name__} comes after its base {shadow.__name__}: it would never match")
        self.rows, self.default = tuple(rows), default

    def lookup(self, error: BaseException) -> T:
        """The value of the first row whose class `error` is an instance of, else `default`."""
        return next((value for cls, value in self.rows if isinstance(error, cls)), self.default)
