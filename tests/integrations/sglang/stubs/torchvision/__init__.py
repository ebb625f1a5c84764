"""An import stub for torchvision, put on PYTHONPATH only for SGLang's child processes.

Why: SGLang 0.5.23 imports torchvision at module level on paths the Mooncake backends load
(sglang/srt/mem_cache/memory_pool -> srt/configs -> multimodal/internvl_utils,
configs/deepseek_ocr), yet no Mooncake path calls it. The registry has no CPU wheel of
torchvision: the one it has is CUDA-linked and fails at import against the CPU torch
(`operator torchvision::nms does not exist`). So the names those modules import exist here,
and anything used raises `NotImplementedError` saying this is the stub.
"""

from __future__ import annotations

import sys

from torchvision._placeholder import SubmoduleFinder, placeholder_getattr

__version__ = "0.0.0+tsukimi-stub"
__getattr__ = placeholder_getattr(__name__)
# NOTE: transformers sees this package (find_spec) and imports torchvision.io and others at
# module level; the finder makes every other torchvision.* submodule a placeholder module.
sys.meta_path.append(SubmoduleFinder(__name__))
