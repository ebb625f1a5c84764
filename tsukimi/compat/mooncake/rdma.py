"""What Mooncake's protocol "rdma" means on tsukimi: the NIXL transport (RDMA NICs through
UCX) where NIXL is installed (`make nixl`), else plain tcp with one warning per process.

SGLang and vLLM default to "rdma" (SGLang's `MOONCAKE_PROTOCOL`); a CPU-only or TCP-only
machine without NIXL must still serve them, over tcp, rather than fail at setup.
"""

from __future__ import annotations

import importlib.util
import logging
import threading

logger = logging.getLogger(__name__)

_warned = threading.Event()


def nixl_installed() -> bool:
    """Whether NIXL's Python package can be imported here (nothing is imported)."""
    return importlib.util.find_spec("nixl_cu12") is not None


def rdma_uses_nixl() -> bool:
    """Whether protocol "rdma" turns the nixl transport on: True with NIXL installed; else
    False, and the first call in this process logs a warning saying tcp is used instead."""
    if nixl_installed():
        return True
    if not _warned.is_set():
        _warned.set()
        logger.warning("protocol rdma: NIXL is not installed here (make nixl); using tcp")
    return False
