"""torchvision.transforms as the stub sees it (see torchvision/__init__.py)."""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
__getattr__ = placeholder_getattr(__name__)
