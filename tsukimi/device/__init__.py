"""Device memory (GPUs): what tsukimi moves without addressing it from the host.

base.py      DeviceRange, the DeviceBackend protocol (copies, IPC export/open, pinning)
cuda.py      NVIDIA GPUs through the CUDA driver API (ctypes; no torch needed)
emulated.py  an emulated device for hosts without a GPU, so CI runs every device path
registry.py  which backend owns memory; device ranges from tensors and raw pointers
"""

from tsukimi.device.base import DeviceBackend, DeviceRange, OpenedRange
from tsukimi.device.emulated import EMULATED, EmulatedDevice, EmulatedMemory
from tsukimi.device.registry import CUDA, backend, device_range, locate, pin_or_warn

__all__ = [
    "CUDA",
    "EMULATED",
    "DeviceBackend",
    "DeviceRange",
    "EmulatedDevice",
    "EmulatedMemory",
    "OpenedRange",
    "backend",
    "device_range",
    "locate",
    "pin_or_warn",
]
