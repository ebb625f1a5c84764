"""How a tensor is laid out as one store object: a fixed 304-byte self-describing header
(dtype, shape, payload size, shard placement) followed by the raw payload.

This module owns that byte format and nothing else: `TensorHeader` packs and checks it,
`serialize` builds an object from a tensor, `serialize_into` writes one into a caller's
buffer, and `deserialize` views an object's payload as a tensor without copying it.

    0      4     6       8      12      16               24                          280        304
    +------+-----+-------+------+-------+----------------+---------------------------+----------+--------
    | TSKT | ver | dtype | ndim | flags | payload_bytes  | shape[32] (u64, unused 0) | shard    | payload
    +------+-----+-------+------+-------+----------------+---------------------------+----------+--------
    shard (280..304): rank u32, size u32 (0: a whole tensor), split_dim i32, 12 bytes reserved

NOTE: the header is 304 bytes because Mooncake's tensor metadata is: code sized for
Mooncake's `[metadata][data]` buffers (304 + nbytes) fits tsukimi's objects exactly. The
bytes themselves are tsukimi's own, all little-endian. The payload starts 16-byte aligned
whenever the object does.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

import torch

from tsukimi.errors import InvalidArgument, InvalidBufferError, KVFormatError

logger = logging.getLogger(__name__)

MAGIC = b"TSKT"
VERSION = 1
MAX_DIMS = 32
HEADER_BYTES = 304
_HEADER = struct.Struct(f"<4sHHIIQ{MAX_DIMS}QIIi12x")
assert _HEADER.size == HEADER_BYTES

# NOTE: codes are part of the stored format: append, never renumber.
_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
)
_CODE_OF: dict[torch.dtype, int] = {}
_DTYPE_OF: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype):
        _CODE_OF[_dtype], _DTYPE_OF[_code] = _code, _dtype


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Where a stored shard sits in the tensor it was cut from: chunk `rank` of `size`
    along `split_dim`. `size == 0` marks a whole tensor."""

    rank: int = 0
    size: int = 0
    split_dim: int = 0


WHOLE = ShardPlacement()


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What an object's header says about its tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: ShardPlacement = WHOLE

    @property
    def payload_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @classmethod
    def of(cls, tensor: torch.Tensor, shard: ShardPlacement = WHOLE) -> TensorHeader:
        """The header of `tensor`. Raises InvalidArgument for a dtype or rank it cannot hold."""
        if tensor.dtype not in _CODE_OF:
            raise InvalidArgument(f"tensors of dtype {tensor.dtype} cannot be stored")
        if tensor.dim() > MAX_DIMS:
            raise InvalidArgument(f"a stored tensor has at most {MAX_DIMS} dims, got {tensor.dim()}")
        return cls(tensor.dtype, tuple(tensor.shape), shard)

    def pack_into(self, buffer: memoryview) -> None:
        """Write the header at the start of `buffer` (mutates it)."""
        shape = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        s = self.shard
        _HEADER.pack_into(
            buffer,
            0,
            MAGIC,
            VERSION,
            _CODE_OF[self.dtype],
            len(self.shape),
            0,
            self.payload_bytes,
            *shape,
            s.rank,
            s.size,
            s.split_dim,
        )

    @classmethod
    def unpack(cls, data: memoryview) -> TensorHeader:
        """Read and check the header at the start of `data`.

        Raises:
            KVFormatError: not a tensor object (short, wrong magic or version, an unknown
                dtype, or a shape that does not match the payload size).
        """
        if len(data) < HEADER_BYTES:
            raise KVFormatError(f"{len(data)} bytes cannot hold a {HEADER_BYTES}-byte tensor header")
        fields = _HEADER.unpack_from(data, 0)
        magic, version, code, ndim, _flags, payload_bytes = fields[:6]
        if magic != MAGIC or version != VERSION:
            raise KVFormatError(f"not a tensor object (magic {magic!r}, version {version})")
        if code not in _DTYPE_OF or ndim > MAX_DIMS:
            raise KVFormatError(f"tensor header with unknown dtype code {code} or {ndim} dims")
        dims = fields[6 : 6 + MAX_DIMS]
        if any(dims[ndim:]):
            raise KVFormatError("tensor header has sizes past its last dim")
        rank, size, split_dim = fields[6 + MAX_DIMS :]
        header = cls(_DTYPE_OF[code], tuple(dims[:ndim]), ShardPlacement(rank, size, split_dim))
        if header.payload_bytes != payload_bytes:
            raise KVFormatError(
                f"tensor header says {payload_bytes} bytes, its shape {header.shape} needs {header.payload_bytes}"
            )
        return header


def as_stored_tensor(value: object) -> torch.Tensor:
    """`value` as a contiguous CPU tensor (copied only if it is not one already).
    Raises InvalidArgument unless it is a torch tensor."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"expected a torch.Tensor, got {type(value).__name__}")
    return value.detach().to("cpu").contiguous()


def serialized_size(tensor: torch.Tensor) -> int:
    """Bytes of the object that stores `tensor`: the header plus its payload."""
    return HEADER_BYTES + tensor.numel() * tensor.element_size()


def serialize(tensor: torch.Tensor, shard: ShardPlacement = WHOLE) -> bytearray:
    """A new object holding `tensor` (one copy of the payload). Raises InvalidArgument."""
    tensor = as_stored_tensor(tensor)
    buffer = bytearray(serialized_size(tensor))
    serialize_into(tensor, memoryview(buffer), shard)
    return buffer


def serialize_into(tensor: torch.Tensor, buffer: memoryview, shard: ShardPlacement = WHOLE) -> torch.Tensor:
    """Write `tensor` as an object at the start of `buffer` (mutates it); returns the copy
    in `buffer`, a tensor sharing its memory.

    Raises:
        InvalidArgument: not a storable tensor.
        InvalidBufferError: `buffer` is smaller than the object.
    """
    tensor = as_stored_tensor(tensor)
    header = TensorHeader.of(tensor, shard)
    if len(buffer) < header.object_bytes:
        raise InvalidBufferError(f"the tensor needs {header.object_bytes} bytes; the buffer holds {len(buffer)}")
    header.pack_into(buffer)
    stored = _payload_view(header, buffer)
    stored.copy_(tensor)
    return stored


def deserialize(data: memoryview | bytearray, exact: bool = True) -> tuple[TensorHeader, torch.Tensor]:
    """The header of the object in `data` and its tensor, a view of `data` (no copy; writes
    to the tensor change `data`). With `exact`, `data` must be exactly the object, else at
    least as long. Raises KVFormatError for anything that is not a whole tensor object."""
    view = memoryview(data).cast("B")
    header = TensorHeader.unpack(view)
    if len(view) < header.object_bytes or (exact and len(view) != header.object_bytes):
        raise KVFormatError(f"a tensor object of {header.object_bytes} bytes, found {len(view)}")
    return header, _payload_view(header, view)


def _payload_view(header: TensorHeader, buffer: memoryview) -> torch.Tensor:
    if header.payload_bytes == 0:  # NOTE: torch.frombuffer refuses empty ranges
        return torch.empty(header.shape, dtype=header.dtype)
    flat = torch.frombuffer(
        buffer, dtype=header.dtype, count=header.payload_bytes // header.dtype.itemsize, offset=HEADER_BYTES
    )
    return flat.view(header.shape)
