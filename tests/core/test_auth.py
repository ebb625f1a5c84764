"""The cluster-secret handshake (tsukimi/auth.py) over socketpairs and a real ConnectionServer,
and HTTP request signing: every mismatch is an AuthError on the connecting side, the server
side serves nothing, and no input makes either side hang or raise anything else."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsukimi import auth, netio, netserver
from tsukimi.errors import AuthError

SECRET = b"0123456789abcdef-the-cluster-secret"
OTHER = b"fedcba9876543210-another-secret!!!"
TICK_S = 0.02


def _deadline(seconds: float = 2.0) -> auth.Expired:
    return auth.deadline_expired(time.monotonic() + seconds)


@contextlib.contextmanager
def _pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    with client, server:
        for sock in (client, server):
            netio.set_io_timeout(sock, TICK_S)
        yield client, server


def _run_both(
    server_secret: bytes | None, client_secret: bytes | None
) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides of the handshake; returns (client error, server error)."""
    outcome: list[BaseException | None] = [None]
    with _pair() as (client, server):

        def serve() -> None:
            try:
                auth.server_handshake(server, server_secret, _deadline())
            except (AuthError, OSError) as exc:
                outcome[0] = exc
            finally:
                with contextlib.suppress(OSError):
                    server.shutdown(socket.SHUT_RDWR)

        thread = threading.Thread(target=serve)
        thread.start()
        client_error: BaseException | None = None
        try:
            auth.client_handshake(client, client_secret, _deadline(), "the test server")
        except (AuthError, OSError) as exc:
            client_error = exc
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        thread.join(5)
        assert not thread.is_alive()
    return client_error, outcome[0]


@pytest.mark.parametrize("secret", [None, SECRET])
def test_matching_secrets_pass(secret: bytes | None) -> None:
    assert _run_both(secret, secret) == (None, None)


def test_a_wrong_secret_is_refused_on_both_sides() -> None:
    client_error, server_error = _run_both(SECRET, OTHER)
    assert isinstance(client_error, AuthError) and "wrong cluster secret" in str(client_error)
    assert "refused" in str(client_error)
    assert isinstance(server_error, AuthError)


def test_a_client_without_the_secret_is_told_how_to_set_it() -> None:
    client_error, server_error = _run_both(SECRET, None)
    assert isinstance(client_error, AuthError)
    assert str(client_error) == (
        "the test server requires the cluster secret; set security.secret_file or TSUKIMI_CLUSTER_SECRET"
    )
    assert isinstance(server_error, OSError)  # the client hung up before proving anything


def test_a_client_with_a_secret_refuses_a_server_without_one() -> None:
    client_error, server_error = _run_both(None, SECRET)
    assert isinstance(client_error, AuthError) and "does not authenticate" in str(client_error)
    assert server_error is None  # it has nothing to check; the client is the one that refuses


def _client_against(script: Callable[[socket.socket], None], secret: bytes | None, seconds: float = 2.0) -> None:
    """Run the client side against a server side that runs `script` (then closes)."""
    with _pair() as (client, server):

        def run() -> None:
            with contextlib.suppress(OSError):
                script(server)
                server.shutdown(socket.SHUT_RDWR)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            auth.client_handshake(client, secret, _deadline(seconds))
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            thread.join(5)


def test_an_impostor_server_that_accepts_anything_is_caught() -> None:
    def impostor(sock: socket.socket) -> None:
        sock.sendall(auth.encode_greeting(True, bytes(32)))
        netio.recv_exact(sock, memoryview(bytearray(auth.PROOF.size)), _deadline())
        sock.sendall(auth.VERDICT.pack(auth.STATUS_OK, bytes(32)))  # "welcome", without the secret

    with pytest.raises(AuthError, match="failed to prove"):
        _client_against(impostor, SECRET)


@pytest.mark.parametrize(
    "greeting",
    [
        b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(13),  # not a tsukimi server
        auth.GREETING.pack(b"TSKA", 2, 0, 0, bytes(32)),  # a future version
        auth.GREETING.pack(b"TSKA", 1, 0x80, 0, bytes(32)),  # unknown flags
        auth.encode_greeting(False, bytes(32))[:17],  # truncated, then closed
    ],
    ids=["garbage", "version", "flags", "truncated"],
)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_malformed_greeting_is_an_auth_error(greeting: bytes, secret: bytes | None) -> None:
    with pytest.raises(AuthError):
        _client_against(lambda sock: sock.sendall(greeting), secret)


def test_a_server_that_hangs_up_at_once_is_a_connection_reset() -> None:
    """Nothing was said: a restarting server or one at its connection limit, not an auth problem."""
    with pytest.raises(ConnectionResetError):
        _client_against(lambda sock: None, SECRET)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_silent_server_times_out_on_time(secret: bytes | None) -> None:
    with _pair() as (client, _server):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            auth.client_handshake(client, secret, _deadline(0.3))
        assert time.monotonic() - start < 0.3 + 0.2


def test_a_server_that_stalls_after_the_greeting_times_out_on_time() -> None:
    with _pair() as (client, server):
        server.sendall(auth.encode_greeting(True, bytes(32)))  # then never answers the proof
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            auth.client_handshake(client, SECRET, _deadline(0.3))
        assert time.monotonic() - start < 0.3 + 0.2


# -- the server side, on a real ConnectionServer --------------------------------------------


class _EchoServer(netserver.ConnectionServer):
    """Echoes one line per connection; counts the connections it served."""

    def __init__(self, secret: bytes | None, handshake_timeout_s: float = 5.0) -> None:
        super().__init__("127.0.0.1", 0, "echo", 16, 0.05, secret)
        self.handshake_timeout_s = handshake_timeout_s
        self.served = 0
        self.start()

    def serve(self, conn: socket.socket, addr: object) -> None:
        self.served += 1
        buf = bytearray(4)
        netio.recv_exact(conn, memoryview(buf), lambda _: self.closed)
        conn.sendall(bytes(buf))


def _client(server: _EchoServer, secret: bytes | None) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=5)
    sock.settimeout(None)
    netio.set_io_timeout(sock, TICK_S)
    try:
        auth.client_handshake(sock, secret, _deadline())
    except BaseException:
        sock.close()
        raise
    return sock


def _echo(sock: socket.socket) -> bytes:
    sock.sendall(b"ping")
    buf = bytearray(4)
    netio.recv_exact(sock, memoryview(buf), _deadline())
    return bytes(buf)


def test_the_server_serves_only_clients_with_the_secret() -> None:
    server = _EchoServer(SECRET)
    try:
        with _client(server, SECRET) as good:
            assert _echo(good) == b"ping"
        for secret, message in ((OTHER, "wrong cluster secret"), (None, "requires the cluster secret")):
            with pytest.raises(AuthError, match=message):
                _client(server, secret)
        with _client(server, SECRET) as again:
            assert _echo(again) == b"ping"
        assert server.served == 2  # serve() never saw the refused ones
    finally:
        server.close()


def test_a_silent_client_is_dropped_and_others_are_served_meanwhile() -> None:
    server = _EchoServer(SECRET, handshake_timeout_s=0.3)
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as silent:
            with _client(server, SECRET) as good:  # not held up by the silent one
                assert _echo(good) == b"ping"
            greeting = silent.recv(auth.GREETING.size, socket.MSG_WAITALL)
            assert auth.decode_greeting(greeting).secret_required
            start = time.monotonic()
            assert silent.recv(16) == b""  # dropped after the handshake timeout (+ a tick)
            assert time.monotonic() - start < 0.3 + 0.5
        assert server.served == 1
    finally:
        server.close()


def test_without_a_secret_the_greeting_is_the_only_cost() -> None:
    server = _EchoServer(None)
    try:
        with _client(server, None) as sock:
            assert _echo(sock) == b"ping"
    finally:
        server.close()


# -- fuzzing the decoders ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=auth.GREETING.size + auth.VERDICT.size + 8), secret=st.sampled_from([None, SECRET]))
def test_fuzzed_server_bytes_never_crash_or_hang_the_client(raw: bytes, secret: bytes | None) -> None:
    with _pair() as (client, server):
        server.sendall(raw)
        server.shutdown(socket.SHUT_WR)
        try:
            auth.client_handshake(client, secret, _deadline(1.0))
        except (AuthError, ConnectionResetError):
            return
        # only a well-formed secret-less greeting gets through, and only to a client without one
        assert secret is None and raw.startswith(b"TSKA\x01\x00")


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=auth.PROOF.size + 8))
def test_fuzzed_client_bytes_never_crash_or_hang_the_server(raw: bytes) -> None:
    with _pair() as (client, server):
        client.sendall(raw)
        client.shutdown(socket.SHUT_WR)
        with pytest.raises((AuthError, ConnectionResetError)):
            auth.server_handshake(server, SECRET, _deadline(1.0))


@given(st.binary())
def test_decoders_raise_only_auth_errors(raw: bytes) -> None:
    for decode in (auth.decode_greeting, auth.decode_proof):
        with contextlib.suppress(AuthError):
            decode(raw)


# -- HTTP request signing ---------------------------------------------------------------------

NOW = 1_700_000_000.0


def _verify(headers: dict[str, str], cache: auth.ReplayCache, **changes: object) -> None:
    fields: dict[str, object] = {"method": "PUT", "path": "/metadata?key=a%2Fb", "body": b"v", "now": NOW + 1}
    fields.update(changes)
    auth.verify_headers(
        SECRET,
        str(fields["method"]),
        str(fields["path"]),
        bytes(fields["body"]),  # type: ignore[call-overload]
        headers,
        float(fields["now"]),  # type: ignore[arg-type]
        replay_cache=cache,
    )


def test_a_signed_request_verifies_once() -> None:
    cache = auth.ReplayCache()
    headers = auth.sign_headers(SECRET, "PUT", "/metadata?key=a%2Fb", b"v", now=NOW)
    _verify(headers, cache)
    with pytest.raises(AuthError, match="replayed"):
        _verify(headers, cache)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"method": "DELETE"}, "bad request signature"),
        ({"path": "/metadata?key=other"}, "bad request signature"),
        ({"body": b"w"}, "bad request signature"),
        ({"now": NOW + 31}, "off this host's clock"),
        ({"now": NOW - 31}, "off this host's clock"),
    ],
)
def test_an_altered_or_stale_request_is_refused(change: dict[str, object], message: str) -> None:
    headers = auth.sign_headers(SECRET, "PUT", "/metadata?key=a%2Fb", b"v", now=NOW)
    with pytest.raises(AuthError, match=message):
        _verify(headers, auth.ReplayCache(), **change)


def test_unsigned_malformed_and_wrongly_keyed_requests_are_refused() -> None:
    cache = auth.ReplayCache()
    with pytest.raises(AuthError, match="unsigned request"):
        _verify({}, cache)
    headers = auth.sign_headers(SECRET, "PUT", "/metadata?key=a%2Fb", b"v", now=NOW)
    with pytest.raises(AuthError, match="malformed"):
        _verify({**headers, auth.HEADER_TIMESTAMP: "nan-ish"}, cache)
    with pytest.raises(AuthError, match="off this host's clock"):
        _verify({**headers, auth.HEADER_TIMESTAMP: "nan"}, cache)
    with pytest.raises(AuthError, match="bad request signature"):
        _verify(auth.sign_headers(OTHER, "PUT", "/metadata?key=a%2Fb", b"v", now=NOW), cache)


def test_the_replay_cache_is_bounded_and_never_readmits_a_dropped_nonce() -> None:
    cache = auth.ReplayCache(max_entries=2)
    assert cache.admit("a", NOW, NOW) and cache.admit("b", NOW + 1, NOW + 1) and cache.admit("c", NOW + 2, NOW + 2)
    assert not cache.admit("a", NOW, NOW + 2)  # dropped from the cache, but under the floor
    assert not cache.admit("c", NOW + 2, NOW + 2)
    assert cache.admit("d", NOW + 3, NOW + 3)
    assert len(cache._seen) == 2
