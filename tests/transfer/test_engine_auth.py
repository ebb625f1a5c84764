"""Transfer Engines and the cluster secret: a peer with the wrong secret (or none) gets a
failed request whose reason says auth, at once, and the target's memory is untouched; a p2p
handshake with it raises AuthError. (The conformance suite's "tcp-secret" case covers the
working path.)"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tsukimi import auth
from tsukimi.config import Config, MetadataConfig, SecurityConfig
from tsukimi.errors import AuthError, ConfigError
from tsukimi.testing.engine_pairs import EnginePair, initiator_config, secret_file
from tsukimi.transfer import OpCode, RequestState, TransferEngine, TransferRequest

SECRET = b"transfer-engine-secret-0123456789"
OTHER = b"not-the-cluster-secret-9876543210"
SIZE = 1 << 20


@pytest.fixture
def target(tmp_path: Path) -> Iterator[tuple[TransferEngine, str]]:
    url = f"memory://{uuid.uuid4().hex}"
    config = Config(metadata=MetadataConfig(url=url), security=secret_file(tmp_path, SECRET, "target"))
    with TransferEngine("target", config) as engine:
        yield engine, url


@pytest.mark.parametrize(
    ("secret", "message"),
    [(OTHER, "wrong cluster secret"), (None, "requires the cluster secret")],
    ids=["wrong", "none"],
)
@pytest.mark.parametrize("op", [OpCode.WRITE, OpCode.READ])
def test_a_request_without_the_right_secret_fails_with_an_auth_reason_and_touches_nothing(
    target: tuple[TransferEngine, str], tmp_path: Path, secret: bytes | None, message: str, op: OpCode
) -> None:
    engine, url = target
    buf = engine.allocate(SIZE)
    buf.view[:] = b"\x11" * SIZE
    security = secret_file(tmp_path, secret, "initiator") if secret else SecurityConfig()
    local = bytearray(b"\x22" * SIZE)
    with TransferEngine("intruder", initiator_config("tcp-4", url, security, timeout_s=5.0)) as intruder:
        start = time.monotonic()
        status = intruder.transfer([TransferRequest(op, "target", buf.base, local)])[0]
        elapsed = time.monotonic() - start
    assert status.state is RequestState.FAILED
    assert status.error_code == "auth"
    assert "auth" in status.reason and message in status.reason
    assert isinstance(status.error(), AuthError)
    assert elapsed < 2.0  # failed at once, not retried until the 5 s deadline
    assert bytes(buf.view) == b"\x11" * SIZE  # the target's memory is untouched
    assert local == b"\x22" * SIZE  # and nothing was read into ours


def test_an_engine_with_a_secret_refuses_a_peer_without_one(tmp_path: Path) -> None:
    url = f"memory://{uuid.uuid4().hex}"
    with TransferEngine("open", Config(metadata=MetadataConfig(url=url))) as open_peer:
        buf = open_peer.allocate(4096)
        config = initiator_config("tcp-1", url, secret_file(tmp_path, SECRET))
        with TransferEngine("careful", config) as careful:
            status = careful.transfer([TransferRequest(OpCode.WRITE, "open", buf.base, b"data")])[0]
        assert bytes(buf.view[:4]) == bytes(4)
    assert status.state is RequestState.FAILED and status.error_code == "auth"
    assert "does not authenticate" in status.reason


def test_p2p_handshake_needs_the_secret(tmp_path: Path) -> None:
    security = secret_file(tmp_path, SECRET, "a")
    with TransferEngine(config=Config(security=security)) as owner:
        buf = owner.allocate(4096)
        with TransferEngine(config=initiator_config("tcp-1", security=secret_file(tmp_path, OTHER, "b"))) as other:
            with pytest.raises(AuthError, match="wrong cluster secret"):
                other.open_segment(owner.name)
            status = other.transfer([TransferRequest(OpCode.WRITE, owner.name, buf.base, b"x")])[0]
            assert status.state is RequestState.FAILED and status.error_code == "auth"
        with TransferEngine(config=initiator_config("tcp-1", security=security)) as member:
            seg = member.open_segment(owner.name)
            member.write(seg, buf.base, b"member")
        assert bytes(buf.view[:6]) == b"member"


def test_a_short_secret_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        TransferEngine(config=Config(security=secret_file(tmp_path, b"short")))


@pytest.mark.parametrize("pair", ["tcp-secret"], indirect=True)
def test_the_conformance_secret_case_really_authenticates(pair: EnginePair) -> None:
    endpoint = pair.target.describe().endpoints[0]
    with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
        greeting = sock.recv(auth.GREETING.size, socket.MSG_WAITALL)
    assert auth.decode_greeting(greeting).secret_required
