"""torchvision.transforms.functional as the stub sees it: the real InterpolationMode values."""

from __future__ import annotations

import enum

from torchvision._placeholder import placeholder_getattr


class InterpolationMode(enum.Enum):
    """The interpolation modes SGLang's configs name at import time (torchvision's values)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = placeholder_getattr(__name__)
