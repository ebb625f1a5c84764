"""Transports join the engine by registering (tsukimi/transfer/transports/base.py): a new
one is built by every engine, tried by rank under "auto", and can be forced by name."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest
from tsukimi.transfer.segment import BufferDescriptor, SegmentDescriptor
from tsukimi.transfer.transports import base
from tsukimi.transfer.transports.base import Slice, TransportContext


class RecordingTransport:
    """Serves only peers named "chosen-*"; completes slices without moving bytes."""

    name = "recording"
    slice_bytes = 1024

    def __init__(self, context: TransportContext) -> None:
        self.context = context
        self.slices: list[tuple[str, int]] = []
        self.closed = False

    def can_serve(self, peer: SegmentDescriptor, buffer: BufferDescriptor) -> bool:
        return peer.name.startswith("chosen-")

    def submit(self, peer: SegmentDescriptor, slices: list[Slice]) -> None:
        for piece in slices:
            self.slices.append((peer.name, len(piece.local)))
            piece.record.slice_done(len(piece.local))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingTransport]:
    built: list[RecordingTransport] = []

    def factory(context: TransportContext) -> RecordingTransport:
        built.append(RecordingTransport(context))
        return built[-1]

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    base.register_transport("recording", factory, rank=1)
    return built


def test_a_registered_transport_is_built_ranked_and_forced(recording: list[RecordingTransport]) -> None:
    names = [n for n in base.transport_names() if n != "nixl"]  # nixl: optional
    assert names == ["recording", "device_ipc", "shm", "cma", "tcp"]
    cfg = Config(metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}"))
    with (
        TransferEngine("chosen-target", cfg) as chosen,
        TransferEngine("other-target", cfg) as other,
        TransferEngine("initiator", cfg) as initiator,
    ):
        a, b = chosen.allocate(1 << 16), other.allocate(1 << 16)
        statuses = initiator.transfer(
            [
                TransferRequest(OpCode.WRITE, "chosen-target", a.base, b"x" * 3000),  # auto: rank 1 first
                TransferRequest(OpCode.WRITE, "other-target", b.base, b"y" * 3000),  # it refuses: shm serves
            ]
        )
        assert [s.state for s in statuses] == [RequestState.COMPLETED] * 2
        mine = recording[-1]
        assert mine.slices == [("chosen-target", 1024), ("chosen-target", 1024), ("chosen-target", 952)]
        assert bytes(a.view[:1]) == b"\0" and bytes(b.view[:3]) == b"yyy"  # only shm moved bytes
        forced = initiator.open_segment("other-target", transport="recording")
        (status,) = initiator.transfer([TransferRequest(OpCode.WRITE, forced, b.base, b"z")])
        assert status.state is RequestState.FAILED and "cannot reach" in status.reason
    assert all(t.closed for t in recording)


def test_unknown_and_reserved_names_are_refused(recording: list[RecordingTransport]) -> None:
    with pytest.raises(ConfigError, match="other than 'auto'"):
        base.register_transport("auto", RecordingTransport, rank=0)
    cfg = Config(metadata=MetadataConfig(url=f"memory://{uuid.uuid4().hex}"))
    with TransferEngine("a", cfg) as engine, pytest.raises(ConfigError, match="recording, device_ipc, shm, cma, tcp"):
        engine.open_segment("a", transport="rdma")
    with pytest.raises(ConfigError, match=r"must be one of auto, recording, device_ipc, shm, cma, tcp"):
        TransferEngine("b", dataclasses.replace(cfg, transfer=TransferConfig(transport="rdma")))
