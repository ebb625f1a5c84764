"""Where the engine computes: the device and dtype a worker asks for, resolved against this
machine, and the few device operations the engine's timing and copies need.

    --device auto   cuda when torch sees a GPU, else cpu       --device cuda without one: ConfigError
    --dtype  auto   bfloat16 on cuda, float32 on cpu (the CPU engine as it always ran)

Everything else in tsukimi/engine is device-agnostic torch: tensors carry their device. The
CUDA-only calls live here and in `StreamOrder` (tsukimi/engine/stream_order.py), each a line or
two behind a `device.type == "cuda"` test, so that the CPU path runs the same code in CI.
"""

from __future__ import annotations

import torch

from tsukimi.config import DEVICE_NAMES, WORKER_DTYPE_NAMES, DTypeName
from tsukimi.errors import ConfigError

CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """The device `name` ("auto", "cpu", "cuda", "cuda:N") means on this machine (pure).

    Raises:
        ConfigError: an unknown name, or cuda asked for where torch sees no GPU.
    """
    kind = name.partition(":")[0]
    if kind not in DEVICE_NAMES:
        raise ConfigError(f"device must be one of {', '.join(DEVICE_NAMES)} (or cuda:N), got {name!r}")
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} was asked for but torch {torch.__version__} sees no CUDA GPU here "
            "(use --device cpu, or auto to pick what is present)"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> DTypeName:
    """The model dtype `name` means on `device`: "auto" is bfloat16 on cuda, float32 elsewhere (pure).

    Raises:
        ConfigError: an unknown name.
    """
    if name not in WORKER_DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {', '.join(WORKER_DTYPE_NAMES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return "float32" if name == "float32" else "bfloat16" if name == "bfloat16" else "float16"


def synchronize(device: torch.device) -> None:
    """Wait until `device` has run everything queued on it: timing a CUDA region needs it on both
    sides, since kernels return before they run. A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 host buffer of `num_bytes` for copies to and from `device`: page-locked when
    `device` is a GPU (a pinned copy runs ~3x a pageable one, GPU.md), plain otherwise."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
