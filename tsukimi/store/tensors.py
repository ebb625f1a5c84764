"""Torch tensors in the store: put and get whole tensors, in batches, into caller buffers,
and tensor-parallel (TP) shards, over a `StoreClient`.

Each tensor is one object: a self-describing header and its payload (tensor_format.py), so
a get needs nothing but the key. Functions here do not keep state; they take the client.
A put copies the payload once, into the object; a `*_serialized` put stores a caller's
buffer already in that layout without copying; a get returns a tensor that is a view of
the bytes read (into a new bytearray, or into the caller's buffer), never copied again.

TP shards: `put_tensor_with_tp` cuts a tensor into `tp_size` equal chunks along
`split_dim` and stores chunk r under `tp_key(key, r)` = `{key}_tp_{r}`; a shard's header
records (r, tp_size, split_dim), so a reader asking with another tp_size is refused.
`tp_size == 1` stores and reads the plain key.

CUDA tensors go through the client's device path (device_io.py): a put stores the header
from host memory and the payload staged from the GPU (a batch's payloads in one device->host
copy); a get into CUDA tensors reads each object as (header, the tensor's bytes), the batch's
payloads in one host->device copy and one scatter, and answers the tensor in the stored dtype
and shape (a view of the caller's); the object must be exactly that many bytes.

Single-key helpers raise what went wrong; batch calls return one `TensorResult` (gets) or
one error-or-None (puts) per key, and raise only for the whole call. A miss is None.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from tsukimi.errors import InvalidArgument, KVFormatError, TsukimiError
from tsukimi.store import protocol as p
from tsukimi.store.client import PinName, StoreClient, replica_config
from tsukimi.store.tensor_format import (
    HEADER_BYTES,
    WHOLE,
    ShardPlacement,
    TensorHeader,
    as_stored_tensor,
    deserialize,
    serialize,
)
from tsukimi.transfer.segment import byte_view

logger = logging.getLogger(__name__)

PutError = TsukimiError | None


@dataclass(frozen=True, slots=True)
class PutOptions:
    """How tensors are stored: replica count, pin ("", "soft", "hard"), preferred
    segments, and `upsert` (replace an object of the same key instead of failing with
    ObjectExists); `config`, when given, replaces the first three (soft pin TTLs and the
    rest of `ReplicaConfig`); `per_key`, when given, is one config per key of the call (each
    key's replica group, writer session), for every object that key is stored as."""

    replicas: int = 1
    pin: PinName = ""
    preferred: tuple[str, ...] = ()
    upsert: bool = False
    config: p.ReplicaConfig | None = None
    per_key: tuple[p.ReplicaConfig, ...] = ()


DEFAULT_PUT = PutOptions()


@dataclass(frozen=True, slots=True)
class TensorResult:
    """One key of a batch get: the tensor (a view of the bytes read), or None on a miss;
    `error` says why a key could not be read (KVFormatError: not a tensor object)."""

    tensor: torch.Tensor | None = None
    error: TsukimiError | None = None

    @property
    def found(self) -> bool:
        return self.tensor is not None

    def value(self) -> torch.Tensor | None:
        """The tensor, or None on a miss. Raises the error of a failed read."""
        if self.error is not None:
            raise self.error
        return self.tensor


@dataclass(frozen=True, slots=True)
class DeviceObject:
    """A tensor object whose payload stays on its device until the put stages it: the header
    (host bytes) and the contiguous device tensor (absent when empty)."""

    header: bytearray
    payload: torch.Tensor | None


Prepared = tuple[str, object] | TsukimiError  # an object (a buffer or a DeviceObject) ready to put, or why not


def put_prepared(
    client: StoreClient, items: Sequence[Prepared], options: PutOptions, owners: Sequence[int] | None = None
) -> list[PutError]:
    """Put the prepared objects in one batch; items that are already an error keep it.
    `owners` names each item's key of the call (its `options.per_key` entry); by default
    item i is key i.

    Raises:
        InvalidArgument: `options.per_key` does not cover every owner.
    """
    ready = [item for item in items if not isinstance(item, TsukimiError)]
    if not ready:
        return [item for item in items if isinstance(item, TsukimiError)]
    configs = _configs_of(items, options, range(len(items)) if owners is None else owners)
    if any(isinstance(value, DeviceObject) for _, value in ready):
        config = options.config or replica_config(options.replicas, options.pin, options.preferred)
        stored = iter(
            client.batch_put_parts(
                [(k, _parts_of(v)) for k, v in ready], config, upsert=options.upsert, configs=configs
            )
        )
    else:
        stored = iter(
            client.batch_put(
                ready,
                options.replicas,
                options.pin,
                options.preferred,
                upsert=options.upsert,
                config=options.config,
                configs=configs,
            )
        )
    return [item if isinstance(item, TsukimiError) else next(stored) for item in items]


def _configs_of(items: Sequence[Prepared], options: PutOptions, owners: Sequence[int]) -> list[p.ReplicaConfig] | None:
    """Each ready item's own config from `options.per_key`, or None when there is none."""
    if not options.per_key:
        return None
    if len(owners) != len(items) or any(not 0 <= i < len(options.per_key) for i in owners):
        raise InvalidArgument(f"{len(options.per_key)} per-key configs do not cover the put's {len(items)} objects")
    return [options.per_key[i] for item, i in zip(items, owners, strict=True) if not isinstance(item, TsukimiError)]


def _parts_of(value: object) -> tuple[object, ...]:
    if isinstance(value, DeviceObject):
        return (value.header,) if value.payload is None else (value.header, value.payload)
    return (value,)


def prepare(key: str, tensor: object, shard: ShardPlacement = WHOLE) -> Prepared:
    """`tensor` serialized for `key` (a CUDA tensor: its header, the payload left on the
    device), or the InvalidArgument that says why it cannot be."""
    try:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            stored = tensor.detach().contiguous()
            if stored.data_ptr() != tensor.data_ptr():
                # NOTE: the copy is queued on torch's stream; the staging reads on its own
                torch.cuda.current_stream(stored.device).synchronize()
            header = bytearray(HEADER_BYTES)
            TensorHeader.of(stored, shard).pack_into(memoryview(header))
            return key, DeviceObject(header, stored if stored.numel() else None)
        return key, serialize(as_stored_tensor(tensor), shard)
    except TsukimiError as exc:
        return exc


def put_tensor(client: StoreClient, key: str, tensor: torch.Tensor, options: PutOptions = DEFAULT_PUT) -> None:
    """Store `tensor` (any device, any strides; copied once) under `key`.

    Raises:
        ObjectExists (not upsert), InvalidArgument (not a storable tensor), OutOfSpace,
        TransferError, RpcTimeout / MasterUnavailable.
    """
    _raise(batch_put_tensors(client, [key], [tensor], options)[0])


def batch_put_tensors(
    client: StoreClient, keys: Sequence[str], tensors: Sequence[torch.Tensor], options: PutOptions = DEFAULT_PUT
) -> list[PutError]:
    """Store each tensor under its key in one batch; each key's error or None.
    Raises InvalidArgument if the lists differ in length."""
    _same_length(keys, tensors)
    return put_prepared(client, [prepare(k, t) for k, t in zip(keys, tensors, strict=True)], options)


def batch_put_serialized(
    client: StoreClient, keys: Sequence[str], buffers: Sequence[object], options: PutOptions = DEFAULT_PUT
) -> list[PutError]:
    """Store buffers that already hold a tensor object (`[header][payload]`, as a get into
    a buffer leaves it) without copying them; bytes past the object are not stored.
    Each key's error or None (KVFormatError: the buffer holds no tensor object)."""
    _same_length(keys, buffers)
    items: list[Prepared] = []
    for key, buffer in zip(keys, buffers, strict=True):
        try:
            view = byte_view(buffer, writable=False, with_address=False)[0]
            header, _ = deserialize(view, exact=False)
            items.append((key, view[: header.object_bytes]))
        except TsukimiError as exc:
            items.append(exc)
    return put_prepared(client, items, options)


def tensor_in(buffer: object) -> torch.Tensor:
    """The tensor of the object at the start of `buffer` (a view of it, no copy).
    Raises InvalidBufferError (not a buffer), KVFormatError (no tensor object there)."""
    return deserialize(byte_view(buffer, writable=False, with_address=False)[0], exact=False)[1]


def get_tensor(client: StoreClient, key: str, device: str | torch.device | None = None) -> torch.Tensor | None:
    """The tensor stored under `key` (moved to `device` when given: one copy from the bytes
    read), or None on a miss. Raises KVFormatError (not a tensor object), TransferError."""
    tensor = batch_get_tensors(client, [key])[0].value()
    return tensor if tensor is None or device is None else tensor.to(device)


def get_tensor_into(client: StoreClient, key: str, buffer: object) -> torch.Tensor | None:
    """Read the object of `key` into `buffer` (any writable buffer: zero-copy; a CUDA tensor:
    its payload, see the module); returns its tensor, a view of `buffer`, or None on a miss.
    Raises InvalidBufferError when the object does not fit, KVFormatError, TransferError."""
    return batch_get_tensors(client, [key], [buffer])[0].value()


def batch_get_tensors(
    client: StoreClient, keys: Sequence[str], into: Sequence[object] | None = None
) -> list[TensorResult]:
    """Each key's tensor, read in one batch into `into[i]` when given (CUDA tensors: their
    payload, see the module), else into new memory. Raises InvalidArgument (a buffer count
    that does not match), RpcTimeout, DeviceError."""
    if into is None or not any(_on_cuda(b) for b in into):
        return [decode_result(r.data, r.error) for r in client.batch_get(keys, into)]
    if len(into) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(into)} buffers")
    results = [TensorResult()] * len(keys)
    host = [i for i, b in enumerate(into) if not _on_cuda(b)]
    cuda = [i for i, b in enumerate(into) if _on_cuda(b)]
    if host:
        for i, r in zip(host, client.batch_get([keys[i] for i in host], [into[i] for i in host]), strict=True):
            results[i] = decode_result(r.data, r.error)
    headers = [bytearray(HEADER_BYTES) for _ in cuda]
    parts = [(h, into[i]) for h, i in zip(headers, cuda, strict=True)]
    read = client.batch_get_parts([keys[i] for i in cuda], parts)
    for i, header, got in zip(cuda, headers, read, strict=True):
        results[i] = _device_result(header, cast(torch.Tensor, into[i]), got.found, got.error)
    return results


def _on_cuda(buffer: object) -> bool:
    return isinstance(buffer, torch.Tensor) and buffer.device.type == "cuda"


def _device_result(header: bytearray, tensor: torch.Tensor, found: bool, error: TsukimiError | None) -> TensorResult:
    """The tensor read into CUDA `tensor` (its bytes in the stored dtype and shape), or why not."""
    if error is not None or not found:
        return TensorResult(error=error)
    try:
        stored = TensorHeader.unpack(memoryview(header))
    except KVFormatError as exc:
        return TensorResult(error=exc)
    if stored.payload_bytes != tensor.numel() * tensor.element_size():
        return TensorResult(error=KVFormatError(f"a tensor of {stored.payload_bytes} bytes read into another size"))
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    return TensorResult(raw.view(stored.dtype).view(stored.shape))


def decode_result(data: bytearray | memoryview | None, error: TsukimiError | None, tp_size: int = 0) -> TensorResult:
    """The `TensorResult` of one object read (a miss when `data` is None); with `tp_size`,
    a shard stored for another TP size is a KVFormatError."""
    if error is not None or data is None:
        return TensorResult(error=error)
    try:
        header, tensor = deserialize(data)
    except KVFormatError as exc:
        return TensorResult(error=exc)
    if tp_size > 1 and header.shard.size not in (0, tp_size):
        return TensorResult(error=KVFormatError(f"a shard of a {header.shard.size}-way split, read as {tp_size}-way"))
    return TensorResult(tensor)


# -- tensor parallelism ---------------------------------------------------------------


def tp_key(key: str, rank: int) -> str:
    """The key of TP shard `rank` of `key`."""
    return f"{key}_tp_{rank}"


def split_uniform(tensor: torch.Tensor, size: int, split_dim: int) -> list[torch.Tensor]:
    """`tensor` cut into `size` equal chunks along `split_dim` (views, no copy).
    Raises InvalidArgument for a bad dim or size, or a dim `size` does not divide."""
    if size < 1:
        raise InvalidArgument(f"a split size must be >= 1, got {size}")
    if not -tensor.dim() <= split_dim < max(tensor.dim(), 1):
        raise InvalidArgument(f"split_dim {split_dim} is out of range for a {tensor.dim()}-dim tensor")
    if tensor.dim() == 0:
        raise InvalidArgument("a 0-dim tensor cannot be split")
    length = tensor.shape[split_dim]
    if length % size:
        raise InvalidArgument(f"dim {split_dim} of size {length} does not split into {size} equal shards")
    step = length // size
    return [tensor.narrow(split_dim, rank * step, step) for rank in range(size)]


def put_tensor_with_tp(
    client: StoreClient,
    key: str,
    tensor: torch.Tensor,
    tp_size: int,
    split_dim: int = 0,
    options: PutOptions = DEFAULT_PUT,
) -> None:
    """Store every TP shard of `tensor`. Raises as `put_tensor` (the first shard's error)."""
    _raise(batch_put_tensors_with_tp(client, [key], [tensor], tp_size, split_dim, options)[0])


def batch_put_tensors_with_tp(
    client: StoreClient,
    keys: Sequence[str],
    tensors: Sequence[torch.Tensor],
    tp_size: int,
    split_dim: int = 0,
    options: PutOptions = DEFAULT_PUT,
) -> list[PutError]:
    """Store every TP shard of every tensor in one batch; each key's first error or None
    (InvalidArgument where the tensor does not split evenly: none of its shards is put)."""
    _same_length(keys, tensors)
    items: list[Prepared] = []
    owners: list[int] = []
    for i, (key, tensor) in enumerate(zip(keys, tensors, strict=True)):
        shards = _prepare_shards(key, tensor, tp_size, split_dim)
        items += shards
        owners += [i] * len(shards)
    errors: list[PutError] = [None] * len(keys)
    for owner, error in zip(owners, put_prepared(client, items, options, owners), strict=True):
        errors[owner] = errors[owner] or error
    return errors


def _prepare_shards(key: str, tensor: object, tp_size: int, split_dim: int) -> list[Prepared]:
    if not isinstance(tensor, torch.Tensor):
        return [InvalidArgument(f"expected a torch.Tensor, got {type(tensor).__name__}")]
    if tp_size == 1:
        return [prepare(key, tensor)]
    try:
        shards = split_uniform(tensor, tp_size, split_dim)
    except InvalidArgument as exc:
        return [exc]
    dim = split_dim % tensor.dim()
    return [prepare(tp_key(key, r), s, ShardPlacement(r, tp_size, dim)) for r, s in enumerate(shards)]


def get_tensor_with_tp(client: StoreClient, key: str, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """TP shard `tp_rank` of `key` (the plain key when tp_size is 1), or None on a miss.
    Raises InvalidArgument (rank out of range), KVFormatError (stored for another
    tp_size), TransferError."""
    return batch_get_tensors_with_tp(client, [key], tp_rank, tp_size)[0].value()


def batch_get_tensors_with_tp(
    client: StoreClient, keys: Sequence[str], tp_rank: int, tp_size: int, into: Sequence[object] | None = None
) -> list[TensorResult]:
    """TP shard `tp_rank` of each key in one batch, into `into[i]` when given.
    Raises InvalidArgument for a rank outside [0, tp_size)."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    shard_keys = list(keys) if tp_size == 1 else [tp_key(k, tp_rank) for k in keys]
    return [decode_result(r.data, r.error, tp_size) for r in client.batch_get(shard_keys, into)]


def _same_length(keys: Sequence[str], values: Sequence[object]) -> None:
    if len(keys) != len(values):
        raise InvalidArgument(f"{len(keys)} keys but {len(values)} values")


def _raise(error: PutError) -> None:
    if error is not None:
        raise error
