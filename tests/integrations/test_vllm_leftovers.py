"""What a stopped vLLM leaves in /dev/shm is removed (tsukimi/integrations/vllm/leftovers.py),
and nothing a live process still maps, nor anything that was there before."""

from __future__ import annotations

import mmap
from pathlib import Path

from tsukimi.integrations.vllm import leftovers


def _file(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    return path


def test_only_new_unmapped_queue_files_are_removed(tmp_path: Path) -> None:
    _file(tmp_path, "psm_before")
    with leftovers.swept(tmp_path):
        _file(tmp_path, "psm_left")
        _file(tmp_path, "not_a_queue")
        live = _file(tmp_path, "psm_live")
        with live.open("r+b") as handle:
            mapped = mmap.mmap(handle.fileno(), mmap.PAGESIZE)  # NOTE: a live queue: some process maps it
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_queue", "psm_before", "psm_live"]
        assert leftovers.mapped_shared_memory(tmp_path) == {"psm_live"}
    finally:
        mapped.close()
    assert leftovers.remove_leftovers(set(), tmp_path) == ["psm_before", "psm_live"]  # unmapped now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_queue"]


def test_a_missing_folder_has_nothing_to_remove(tmp_path: Path) -> None:
    gone = tmp_path / "nowhere"
    assert leftovers.shared_memory_names(gone) == set() and leftovers.remove_leftovers(set(), gone) == []
