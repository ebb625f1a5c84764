"""The order between the forward and the KV copies that overlap it, on one device.

The forward runs on the device's current stream. Copies between the KV cache and the host
(the KV pool's publish and load, tsukimi/engine/kv_staging.py) run on a side stream, so that
they overlap the forward, and meet it at markers::

    forward (current stream):  [ layer l stores K/V ] mark ----------------- wait(loaded[l]) [ attention l ]
    side stream:                                    wait -> gather + D2H -> mark -> host waits, then puts
                                 get into staging -> H2D + scatter -> mark loaded[l]

On a GPU a marker is a CUDA event: `side()` makes the side stream current for a block of
copies, `*_waits` make a stream (or the host) wait for a marker. On the CPU every copy is
synchronous when it returns, so markers are None and every wait is a no-op: the same callers
run unchanged in CI, and the threads that issue the copies (layer_loading.py, kv_pool.py) give
the order there. This class is the only CUDA stream code of the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

Marker = torch.cuda.Event | None
"""A point in a stream's work (a CUDA event), or None on the CPU (already reached)."""


class StreamOrder:
    """A side stream beside `device`'s current one, and the per-layer markers of loads into the
    cache (`loaded` / `wait_loaded`). Thread-safe as CUDA streams are: one marker is written by
    one thread and read by another only after a handover (a future's result)."""

    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._loaded: list[Marker] = [None] * num_layers

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the block's device work on the side stream (on the CPU: as it comes)."""
        if self._side is None:
            yield
            return
        with torch.cuda.stream(self._side):
            yield

    def mark_current(self) -> Marker:
        """A marker after everything queued so far on the current stream (the forward's)."""
        return self._record(None)

    def mark_side(self) -> Marker:
        """A marker after everything queued so far on the side stream."""
        return self._record(self._side)

    def _record(self, stream: torch.cuda.Stream | None) -> Marker:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def side_waits(self, marker: Marker) -> None:
        """Later side-stream work starts after `marker` (the host does not block)."""
        if marker is not None and self._side is not None:
            self._side.wait_event(marker)

    def current_waits(self, marker: Marker) -> None:
        """Later current-stream work (the forward) starts after `marker` (the host does not block)."""
        if marker is not None:
            torch.cuda.current_stream(self.device).wait_event(marker)

    @staticmethod
    def host_waits(marker: Marker) -> None:
        """Block this thread until `marker` is reached (e.g. before a staged buffer is read or reused)."""
        if marker is not None:
            marker.synchronize()

    def loaded(self, layer: int, marker: Marker) -> None:
        """Loads of `layer` into the cache are queued up to `marker` (mutates)."""
        self._loaded[layer] = marker

    def wait_loaded(self, layer: int) -> None:
        """The forward reads `layer` of the cache only after its loads (mutates: the marker is used)."""
        marker, self._loaded[layer] = self._loaded[layer], None
        self.current_waits(marker)
