"""Weights and files through the P2P store: torch state dicts published and received in place,
and whole files (safetensors checkpoints) memory-mapped rather than copied.

    publish_state_dict(store, "llama-step-900", model.state_dict())   # registers the tensors
    receive_state_dict(store, "llama-step-900", model.state_dict())   # fills the parameters
    publish_file(store, "ckpt", "model.safetensors")                   # mmap, no copy
    fetch_to_file(store, "ckpt", "out.safetensors")                    # READs into a mapped file

A state dict's manifest (names, dtypes, shapes, in order) travels in the record's `meta`, so
a receiver checks that its tensors match before any byte lands in them. Tensors that share
memory with an earlier one (tied embeddings) travel once and are listed as aliases; empty
tensors travel not at all.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsukimi.errors import InvalidArgument
from tsukimi.p2p.records import PayloadInfo
from tsukimi.p2p.store import P2PStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

STATE_DICT_KIND = "torch-state-dict"
DEVICE_TYPES = ("cpu", "cuda")  # NOTE: CUDA tensors are registered as device memory (GPU to GPU)
FILE_KIND = "file"


def publish_state_dict(
    store: P2PStore, name: str, state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int | None = None
) -> PayloadInfo:
    """Register the tensors of `state_dict` as payload `name`, in place (a non-contiguous
    tensor is copied once). They must not change while registered. Mutates the store.

    Raises:
        InvalidArgument: not a mapping of CPU or CUDA tensors, or nothing to publish. What
        `P2PStore.register` raises.
    """
    entries, buffers = _manifest(state_dict)
    if not buffers:
        raise InvalidArgument("the state dict has no non-empty tensor to publish")
    meta = json.dumps({"kind": STATE_DICT_KIND, "tensors": entries}).encode()
    return store.register(name, buffers, max_shard_bytes, meta=meta)


def _manifest(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    import torch

    if not isinstance(state_dict, Mapping):
        raise InvalidArgument(f"a state dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
    entries: list[dict[str, Any]] = []
    buffers: list[torch.Tensor] = []
    seen: dict[tuple[int, int, str, tuple[int, ...]], str] = {}
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type not in DEVICE_TYPES:
            raise InvalidArgument(f"state dict entry {key!r} is not a CPU or CUDA tensor")
        entry: dict[str, Any] = {"name": key, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
        identity = (tensor.data_ptr(), tensor.nbytes, str(tensor.dtype), tuple(tensor.shape))
        if tensor.nbytes and identity in seen and tensor.is_contiguous():
            entry["alias"] = seen[identity]
        elif tensor.nbytes:
            seen[identity] = key
            buffers.append(tensor if tensor.is_contiguous() else tensor.contiguous())
        entries.append(entry)
    return entries, buffers


def receive_state_dict(store: P2PStore, name: str, into: Mapping[str, torch.Tensor]) -> PayloadInfo:
    """Pull payload `name` (a published state dict) straight into the tensors of `into`,
        which must match its manifest exactly (names, dtypes, shapes; contiguous CPU or CUDA tensors:
    a publisher's and a receiver's devices may differ).
        Afterwards this store holds a replica (its tensors serve other readers) until
        `store.delete_replica(name)`. Mutates the tensors and the store.

        Raises:
            InvalidArgument: `name` is not a state dict, or `into` does not match it (no byte was
            written then). What `P2PStore.get_replica` raises (bytes may be partly written).
    """
    info = store.describe(name)
    entries = _entries(name, info.meta)
    targets = _targets(name, entries, into)
    store.get_replica(name, targets)
    for entry in entries:
        alias = entry.get("alias")
        if alias is not None and into[entry["name"]].data_ptr() != into[alias].data_ptr():
            into[entry["name"]].copy_(into[alias])
    return store.describe(name)


def _entries(name: str, meta: bytes) -> list[dict[str, Any]]:
    try:
        manifest = json.loads(meta)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("kind") != STATE_DICT_KIND:
        raise InvalidArgument(f"P2P payload {name!r} is not a published state dict")
    entries: list[dict[str, Any]] = manifest["tensors"]
    return entries


def _targets(name: str, entries: list[dict[str, Any]], into: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    expected = {entry["name"] for entry in entries}
    if set(into) != expected:
        missing, extra = sorted(expected - set(into)), sorted(set(into) - expected)
        raise InvalidArgument(f"tensors do not match P2P payload {name!r}: missing {missing[:5]}, extra {extra[:5]}")
    targets = []
    for entry in entries:
        tensor = into[entry["name"]]
        if str(tensor.dtype) != entry["dtype"] or list(tensor.shape) != entry["shape"]:
            raise InvalidArgument(
                f"{entry['name']!r} is {tensor.dtype} {list(tensor.shape)}; P2P payload {name!r} has "
                f"{entry['dtype']} {entry['shape']}"
            )
        if tensor.device.type not in DEVICE_TYPES or not tensor.is_contiguous():
            raise InvalidArgument(f"{entry['name']!r} must be a contiguous CPU or CUDA tensor to receive into")
        if "alias" not in entry and tensor.nbytes:
            targets.append(tensor)
    return targets


def publish_file(store: P2PStore, name: str, path: str | Path, max_shard_bytes: int | None = None) -> PayloadInfo:
    """Register the file at `path` as payload `name`: mapped copy-on-write (no copy; the file
    is never written), registered, its name and size in the manifest. The file must not
    change while registered. Mutates the store.

    Raises:
        InvalidArgument: not a readable, non-empty regular file. What `register` raises.
    """
    file = Path(path)
    try:
        with file.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise InvalidArgument(f"{file} is empty")
            mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise InvalidArgument(f"cannot map {file}: {exc}") from exc
    meta = json.dumps({"kind": FILE_KIND, "file_name": file.name, "size": size}).encode()
    return store.register(name, [mapped], max_shard_bytes, meta=meta)


def fetch_to_file(store: P2PStore, name: str, path: str | Path, *, keep_replica: bool = False) -> PayloadInfo:
    """READ payload `name` into a new file at `path` (created or truncated, mapped shared).
    With `keep_replica` the file's mapping keeps serving other readers until
    `store.delete_replica(name)`; otherwise the copy is withdrawn once written.

    Raises:
        InvalidArgument: the path cannot be written. What `get_replica` raises (the file is
        removed then).
    """
    info = store.describe(name)
    file = Path(path)
    try:
        with file.open("w+b") as handle:
            handle.truncate(info.total_bytes)
            mapped = mmap.mmap(handle.fileno(), info.total_bytes, access=mmap.ACCESS_WRITE)
    except OSError as exc:
        raise InvalidArgument(f"cannot write {file}: {exc}") from exc
    try:
        info = store.get_replica(name, [mapped])
        mapped.flush()
    except BaseException:
        file.unlink(missing_ok=True)
        raise
    if not keep_replica:
        store.delete_replica(name)
    return info
