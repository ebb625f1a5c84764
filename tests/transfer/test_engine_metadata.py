"""The engine over every way of finding peers: in-process, embedded HTTP server, real etcd,
and the p2p handshake. In each, two engines transfer, and a buffer registered after the peer
opened the segment is reachable (descriptor updates reach peers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.etcd_server import run_etcd
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.errors import ConfigError, SegmentNotFound
from tsukimi.transfer import TransferEngine
from tsukimi.transfer.metadata import SEGMENT_PREFIX, connect_metadata
from tsukimi.transfer.metadata.http import start_in_thread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "http", "etcd", "p2p"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield f"memory://{uuid.uuid4().hex}"
    elif request.param == "http":
        handle, port = start_in_thread()
        try:
            yield f"http://127.0.0.1:{port}/metadata"
        finally:
            handle.stop()
    elif request.param == "etcd":
        with run_etcd(tmp_path) as etcd:
            yield etcd.url
    else:
        yield "p2p"


def _engine(url: str, name: str | None, transport: str = "auto") -> TransferEngine:
    cfg = Config(transfer=TransferConfig(transport=transport), metadata=MetadataConfig(url=url))  # type: ignore[arg-type]
    return TransferEngine(None if url == "p2p" else name, cfg)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_transfer_and_late_registration_reach_the_peer(metadata_url: str, transport: str) -> None:
    with _engine(metadata_url, "owner", transport) as owner, _engine(metadata_url, "user", transport) as user:
        first = owner.allocate(1 << 20)
        seg = user.open_segment(owner.name)
        user.write(seg, first.base, b"hello")
        assert bytes(first.view[:5]) == b"hello"
        # registered after `user` cached the descriptor: the first request re-fetches it
        late = owner.allocate(1 << 20)
        user.write(seg, late.base + 100, b"late buffer")
        assert bytes(late.view[100:111]) == b"late buffer"
        plain = np.zeros(4096, np.uint8)  # not shared memory: reachable over tcp only
        base = owner.register(plain)
        if transport == "tcp":
            user.write(seg, base, b"plain")
            assert bytes(plain[:5]) == b"plain"


def test_closing_withdraws_the_segment(metadata_url: str) -> None:
    if metadata_url == "p2p":
        owner = _engine(metadata_url, None)
        name = owner.name
        owner.close()
    else:
        owner = _engine(metadata_url, "gone")
        name = owner.name
        backend = connect_metadata(MetadataConfig(url=metadata_url))
        assert backend is not None and backend.get(SEGMENT_PREFIX + name) is not None
        owner.close()
        assert backend.get(SEGMENT_PREFIX + name) is None
        backend.close()
    with _engine(metadata_url, "other") as other, pytest.raises(SegmentNotFound):
        other.open_segment(name)


def test_p2p_names_are_the_server_address() -> None:
    with pytest.raises(ConfigError, match="p2p"):
        TransferEngine("not-an-address", Config())
    with _engine("p2p", None) as a, pytest.raises(ConfigError, match="host:port"):
        a.open_segment("no-port-here")


def test_p2p_handshake_teaches_both_sides(tmp_path: Path) -> None:
    with _engine("p2p", None) as a, _engine("p2p", None) as b:
        buf = b.allocate(4096)
        a.write(b.name, buf.base, b"hi")
        # b learnt a's descriptor from the handshake, so it can reach a without asking
        assert b._directory.cached(a.name) is not None
        back = a.allocate(4096)
        b.write(a.name, back.base, b"yo")
        assert bytes(back.view[:2]) == b"yo"
