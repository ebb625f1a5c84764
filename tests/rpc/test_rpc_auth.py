"""RPC with the cluster secret: calls work with the same secret on both sides; any mismatch is
an AuthError on the client at once (never retried until the deadline), and the handler never
sees the request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from tsukimi import auth
from tsukimi.errors import AuthError, RpcTimeout
from tsukimi.rpc import Codec, RpcClient, RpcServer

SECRET = b"an-rpc-cluster-secret-0123456789"
OTHER = b"a-different-secret-9876543210abcd"


class Ping(msgspec.Struct, tag=True, frozen=True):
    text: str


class Pong(msgspec.Struct, tag=True, frozen=True):
    text: str


CODEC = Codec([Ping], [Pong])


class _Handler:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, request: msgspec.Struct) -> msgspec.Struct:
        assert isinstance(request, Ping)
        self.calls.append(request.text)
        return Pong(request.text)


@pytest.fixture
def handler() -> _Handler:
    return _Handler()


@pytest.fixture
def server(handler: _Handler) -> Iterator[RpcServer]:
    with RpcServer(CODEC, handler, name="auth-test", secret=SECRET) as srv:
        yield srv


def test_calls_work_with_the_secret(server: RpcServer, handler: _Handler) -> None:
    with RpcClient(CODEC, server.endpoint, timeout_s=2.0, secret=SECRET) as client:
        assert client.call_as(Ping("a"), Pong) == Pong("a")
        assert client.call_as(Ping("b"), Pong) == Pong("b")  # the same, authenticated connection
    assert handler.calls == ["a", "b"]


@pytest.mark.parametrize(
    ("secret", "message"),
    [(None, "requires the cluster secret; set security.secret_file"), (OTHER, "refused.*wrong cluster secret")],
    ids=["none", "wrong"],
)
def test_a_client_without_the_right_secret_fails_at_once_and_touches_nothing(
    server: RpcServer, handler: _Handler, secret: bytes | None, message: str
) -> None:
    with RpcClient(CODEC, server.endpoint, timeout_s=5.0, secret=secret) as client:
        start = time.monotonic()
        with pytest.raises(AuthError, match=message) as info:
            client.call(Ping("intruder"))
        assert info.value.code == "auth"
        assert time.monotonic() - start < 1.0  # not retried until the 5 s deadline
        with pytest.raises(AuthError):  # and again on the next call: a fresh connection, same verdict
            client.call(Ping("intruder again"))
    assert handler.calls == []
    with RpcClient(CODEC, server.endpoint, timeout_s=2.0, secret=SECRET) as member:
        assert member.call_as(Ping("member"), Pong) == Pong("member")  # the server kept serving
    assert handler.calls == ["member"]


def test_a_client_with_a_secret_refuses_a_server_without_one(handler: _Handler) -> None:
    with (
        RpcServer(CODEC, handler, name="open") as open_server,
        RpcClient(CODEC, open_server.endpoint, timeout_s=2.0, secret=SECRET) as client,
        pytest.raises(AuthError, match="does not authenticate"),
    ):
        client.call(Ping("to an impostor?"))
    assert handler.calls == []


def test_without_secrets_nothing_changes(handler: _Handler) -> None:
    with RpcServer(CODEC, handler) as srv, RpcClient(CODEC, srv.endpoint, timeout_s=2.0) as client:
        assert client.call_as(Ping("plain"), Pong) == Pong("plain")


def test_a_server_stalled_in_the_handshake_is_a_timeout_not_an_auth_error(
    server: RpcServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A silent server may just be busy or stopped: the caller sees RpcTimeout (retriable)."""

    def never(sock: object, secret: object, expired: object) -> None:
        time.sleep(1.0)

    monkeypatch.setattr(auth, "server_handshake", never)
    with RpcClient(CODEC, server.endpoint, timeout_s=0.3, secret=SECRET) as client:
        start = time.monotonic()
        with pytest.raises(RpcTimeout):
            client.call(Ping("anyone?"))
        assert time.monotonic() - start < 0.3 + 0.3
