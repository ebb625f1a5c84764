"""`MooncakeDistributedStore.save_tensor_to_safetensor` / `load_tensor_from_safetensor`: one
stored tensor to and from a safetensors file, with the wheel's answers (0.3.13.post1, probed):

| call                                  | wheel / here                                              |
|---------------------------------------|-----------------------------------------------------------|
| save(key, file_name=None)             | writes {key: tensor} to file_name (default: key, in the   |
|                                       | working directory); 0; -1100 when the key holds no tensor |
|                                       | (missing, or raw bytes); -600 when the file cannot be made |
| load(key=None, file_name)             | puts the file's tensor named key (else its first, with a  |
|                                       | warning) under key (default: file_name); returns it, None |
|                                       | when the file cannot be read or the put fails             |

A load of a key that already exists answers the tensor and keeps the stored one, as the
wheel's put does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OK

logger = logging.getLogger(__name__)

TENSOR_NOT_FOUND = -1100  # NOTE: the wheel's answer to saving a key that holds no tensor


def save(get_tensor: Callable[[str], torch.Tensor | None], key: str, file_name: str | None) -> int:
    """Write the tensor under `key` to `file_name` (default `key`): 0 or a negative code.

    Raises:
        TypeError: `key` is not a str, `file_name` not a str or None (as the wheel's bindings).
    """
    _check(key=key, file_name=file_name, key_optional=False)
    tensor = get_tensor(key)
    if tensor is None:
        logger.error("save_tensor_to_safetensor: %r holds no tensor", key)
        return TENSOR_NOT_FOUND
    try:
        save_file({key: tensor.contiguous()}, file_name or key)
    except (OSError, SafetensorError) as exc:
        logger.error("save_tensor_to_safetensor %r: %s", key, exc)
        return INVALID_PARAMS
    return OK


def load(put_tensor: Callable[[str, torch.Tensor], int], key: str | None, file_name: str) -> torch.Tensor | None:
    """Put a tensor of `file_name` under `key` (default `file_name`); the tensor, or None.

    Raises:
        TypeError: `file_name` is not a str, `key` not a str or None.
    """
    _check(key=key, file_name=file_name, key_optional=True)
    if not file_name:
        raise TypeError("load_tensor_from_safetensor() needs a file_name")
    name = key or file_name
    try:
        with safe_open(file_name, "pt") as tensors:
            names = list(tensors.keys())
            if not names:
                logger.error("load_tensor_from_safetensor: %s holds no tensor", file_name)
                return None
            if name not in names:
                logger.warning("load_tensor_from_safetensor: %r is not in %s; loading %r", name, file_name, names[0])
            tensor: torch.Tensor = tensors.get_tensor(name if name in names else names[0])
    except (OSError, SafetensorError) as exc:
        logger.error("load_tensor_from_safetensor %s: %s", file_name, exc)
        return None
    return tensor if put_tensor(name, tensor) == OK else None


def _check(*, key: object, file_name: object, key_optional: bool) -> None:
    if not (isinstance(key, str) or (key_optional and key is None)):
        raise TypeError(f"key must be a str{' or None' if key_optional else ''}, got {key!r}")
    if not (isinstance(file_name, str) or (not key_optional and file_name is None)):
        raise TypeError(f"file_name must be a str{'' if key_optional else ' or None'}, got {file_name!r}")
