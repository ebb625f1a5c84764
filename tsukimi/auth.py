"""The optional cluster secret: an HMAC-SHA256 challenge-response on every control-plane (RPC)
and Transfer Engine connection, and signed requests for the HTTP control plane.

Every accepted connection starts with the server's greeting, secret or not, so that each
side learns whether the other expects the secret before anything else is exchanged:

    client                                          server
      |  <--- greeting: "TSKA" v1 flags Ns (40 B) ---  |  flags bit 0: the secret is required
      |                                                |  (no secret: done, serve() starts)
      |  --- "TSKC" Nc HMAC(K, LC|Ns|Nc) (68 B) ---->  |  compare_digest
      |  <--- verdict: 0 HMAC(K, LS|Nc|Ns) (33 B) ---  |  or 1 + zeros, then close: touched nothing
      |  compare_digest: the server knows K too        |

Both sides refuse a mismatch: a client without the secret meets a server that requires it,
or a client with one meets a server without (mutual authentication). Ns and Nc are 32 random
bytes, LC/LS domain-separation labels, so that neither proof can be replayed or reflected.
Only the handshake is authenticated: the bytes that follow are neither encrypted nor MACed.

Errors: AuthError for a refusal or a malformed handshake; TimeoutError when the deadline
passes (a silent or stalled peer); ConnectionResetError when the peer hangs up before sending
a byte of a message (a restart, a server at its connection limit).

HTTP requests are signed with `sign_headers` and checked with `verify_headers` (a timestamp
within `MAX_SKEW_S`, a nonce never seen before, an HMAC over method, path, query and body).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tsukimi import netio
from tsukimi.errors import AuthError

logger = logging.getLogger(__name__)

GREETING = struct.Struct("!4sBBH32s")  # magic, version, flags, reserved, server nonce
PROOF = struct.Struct("!4s32s32s")  # magic, client nonce, HMAC(K, LABEL_CLIENT | Ns | Nc)
VERDICT = struct.Struct("!B32s")  # status, HMAC(K, LABEL_SERVER | Nc | Ns) (zeros on refusal)
GREETING_MAGIC, PROOF_MAGIC, VERSION = b"TSKA", b"TSKC", 1
FLAG_SECRET_REQUIRED = 0x01
STATUS_OK, STATUS_REFUSED = 0, 1
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0  # how long a server waits for a client's proof
LABEL_CLIENT = b"tsukimi-auth-v1 client proof\x00"
LABEL_SERVER = b"tsukimi-auth-v1 server proof\x00"
LABEL_HTTP = b"tsukimi-auth-v1 http request\x00"
NO_SECRET_HINT = "set security.secret_file or TSUKIMI_CLUSTER_SECRET"

Expired = Callable[[int], bool]


@dataclass(frozen=True, slots=True)
class Greeting:
    """What the server's first message says."""

    secret_required: bool
    server_nonce: bytes


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def encode_greeting(secret_required: bool, server_nonce: bytes) -> bytes:
    return GREETING.pack(GREETING_MAGIC, VERSION, FLAG_SECRET_REQUIRED if secret_required else 0, 0, server_nonce)


def decode_greeting(raw: bytes) -> Greeting:
    """Parse a server greeting (pure). Raises AuthError when it is not one we speak."""
    if len(raw) != GREETING.size:
        raise AuthError(f"malformed handshake greeting: {len(raw)} bytes, expected {GREETING.size}")
    magic, version, flags, _reserved, nonce = GREETING.unpack(raw)
    if magic != GREETING_MAGIC:
        raise AuthError(f"not a tsukimi server: the handshake greeting starts with {magic!r}")
    if version != VERSION or flags & ~FLAG_SECRET_REQUIRED:
        raise AuthError(f"unsupported handshake (version {version}, flags {flags:#x}); expected version {VERSION}")
    return Greeting(bool(flags & FLAG_SECRET_REQUIRED), nonce)


def decode_proof(raw: bytes) -> tuple[bytes, bytes]:
    """Parse a client's proof into (client nonce, mac) (pure). Raises AuthError when malformed."""
    if len(raw) != PROOF.size:
        raise AuthError(f"malformed handshake proof: {len(raw)} bytes, expected {PROOF.size}")
    magic, nonce, mac = PROOF.unpack(raw)
    if magic != PROOF_MAGIC:
        raise AuthError(f"malformed handshake proof: starts with {magic!r}")
    return nonce, mac


def _recv(sock: socket.socket, size: int, expired: Expired, what: str) -> bytes:
    """Exactly `size` bytes. Raises ConnectionResetError (closed before the first byte),
    AuthError (closed part-way), TimeoutError, OSError."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = [0]

    def tick(pos: int) -> bool:
        got[0] = pos
        return expired(pos)

    try:
        netio.recv_exact(sock, view, tick, strict=True)
    except ConnectionResetError as exc:
        # NOTE: with strict=True recv_exact reports every partial fill to `tick`, so got[0]
        # tells a hang-up before the message from one in the middle of it.
        if got[0]:
            raise AuthError(f"the peer closed the connection in the middle of the {what}") from exc
        raise
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes | None, expired: Expired) -> None:
    """Run the server's side on a freshly accepted connection (before anything is served).

    Args:
        sock: blocking, with an I/O timeout tick (netio.set_io_timeout).
        secret: the cluster secret; None accepts every client (the greeting says so).
        expired: called at each tick with the bytes read so far; True ends the wait.

    Raises:
        AuthError: the client's proof is malformed or wrong (a refusal was sent).
        TimeoutError: the client stayed silent past `expired`.
        OSError: the client hung up, or the socket failed.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    netio.send_all(sock, [encode_greeting(secret is not None, nonce)], lambda: expired(0))
    if secret is None:
        return
    client_nonce, mac = decode_proof(_recv(sock, PROOF.size, expired, "handshake proof"))
    if not hmac.compare_digest(mac, _mac(secret, LABEL_CLIENT, nonce, client_nonce)):
        netio.send_all(sock, [VERDICT.pack(STATUS_REFUSED, bytes(32))], lambda: expired(0))
        raise AuthError("wrong cluster secret: the client's proof does not match")
    netio.send_all(sock, [VERDICT.pack(STATUS_OK, _mac(secret, LABEL_SERVER, client_nonce, nonce))], lambda: expired(0))


def client_handshake(sock: socket.socket, secret: bytes | None, expired: Expired, peer: str = "the server") -> None:
    """Run the client's side right after connecting (before sending anything else).

    Args:
        sock: connected, blocking, with an I/O timeout tick (netio.set_io_timeout).
        secret: the cluster secret, or None.
        expired: called at each tick with the bytes read so far; True ends the wait.
        peer: names the server in error messages.

    Raises:
        AuthError: the server requires a secret we lack, or has none while we have one, or
            refused ours, or failed to prove it knows it, or sent a malformed handshake.
        TimeoutError: no (complete) answer before `expired`.
        ConnectionResetError: the server closed the connection before a message began.
        OSError: the socket failed.
    """
    greeting = decode_greeting(_recv(sock, GREETING.size, expired, "handshake greeting"))
    if secret is None:
        if greeting.secret_required:
            raise AuthError(f"{peer} requires the cluster secret; {NO_SECRET_HINT}")
        return
    if not greeting.secret_required:
        raise AuthError(f"{peer} does not authenticate (it has no cluster secret) but this side has one; refusing it")
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    proof = PROOF.pack(PROOF_MAGIC, client_nonce, _mac(secret, LABEL_CLIENT, greeting.server_nonce, client_nonce))
    netio.send_all(sock, [proof], lambda: expired(0))
    status, mac = VERDICT.unpack(_recv(sock, VERDICT.size, expired, "handshake verdict"))
    if status == STATUS_REFUSED:
        raise AuthError(f"{peer} refused the handshake: wrong cluster secret")
    if status != STATUS_OK:
        raise AuthError(f"malformed handshake verdict from {peer}: status {status}")
    if not hmac.compare_digest(mac, _mac(secret, LABEL_SERVER, client_nonce, greeting.server_nonce)):
        raise AuthError(f"{peer} failed to prove it knows the cluster secret (wrong secret, or an impostor)")


def deadline_expired(deadline: float, stop: Callable[[], bool] | None = None) -> Expired:
    """An `expired` callback for a monotonic `deadline` (and an optional stop flag).

    NOTE: time.monotonic directly: the handshake runs on real sockets, hence real time.
    """
    return lambda _got: (stop is not None and stop()) or time.monotonic() >= deadline


# -- HTTP request signing ----------------------------------------------------------------

HEADER_TIMESTAMP = "x-tsukimi-timestamp"
HEADER_NONCE = "x-tsukimi-nonce"
HEADER_SIGNATURE = "x-tsukimi-signature"
MAX_SKEW_S = 30.0
REPLAY_CACHE_ENTRIES = 65536


def _request_mac(secret: bytes, method: str, path_with_query: str, body: bytes, stamp: str, nonce: str) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = "\n".join((method.upper(), path_with_query, stamp, nonce, digest)).encode()
    return hmac.new(secret, LABEL_HTTP + message, hashlib.sha256).hexdigest()


def wall_time() -> float:
    """Seconds since the epoch.

    NOTE: wall-calendar time, not the monotonic Clock: a request's two ends are different
    hosts, and only calendar time is (roughly) shared between them.
    """
    return time.time()


def sign_headers(
    secret: bytes, method: str, path_with_query: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """The headers that authenticate one HTTP request (pure but for the nonce and the clock).

    Args:
        path_with_query: exactly as sent on the request line, e.g. "/metadata?key=a%2Fb".
        now: wall-clock seconds since the epoch; the current time when None.

    Returns:
        x-tsukimi-timestamp, x-tsukimi-nonce and x-tsukimi-signature (an HMAC-SHA256 over
        the method, the path and query, the timestamp, the nonce and the body's SHA-256).
    """
    stamp = f"{wall_time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    return {
        HEADER_TIMESTAMP: stamp,
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: _request_mac(secret, method, path_with_query, body, stamp, nonce),
    }


class ReplayCache:
    """Nonces seen within the skew window, bounded. Thread-safe.

    When full, the oldest entry is dropped and its timestamp becomes a floor: any request
    stamped at or before it is refused, so a dropped nonce can never be replayed.
    """

    def __init__(self, max_entries: int = REPLAY_CACHE_ENTRIES, window_s: float = MAX_SKEW_S) -> None:
        self._max = max_entries
        self._window_s = window_s
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._floor = float("-inf")

    def admit(self, nonce: str, stamp: float, now: float) -> bool:
        """Remember `nonce`; False when it was seen before or is under the floor (mutates)."""
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - 2 * self._window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen or stamp <= self._floor:
                return False
            self._seen[nonce] = stamp
            if len(self._seen) > self._max:
                _, dropped = self._seen.popitem(last=False)
                self._floor = max(self._floor, dropped)
            return True


_DEFAULT_REPLAY_CACHE = ReplayCache()


def verify_headers(
    secret: bytes,
    method: str,
    path_with_query: str,
    body: bytes,
    headers: Mapping[str, str],
    now: float,
    *,
    replay_cache: ReplayCache | None = None,
) -> None:
    """Check the signature headers of one HTTP request (mutates the replay cache).

    Args:
        headers: the request's headers, looked up by lowercase name.
        now: wall-clock seconds since the epoch.
        replay_cache: where nonces are remembered; a process-wide one when None.

    Raises:
        AuthError: a header is missing or malformed, the timestamp is more than MAX_SKEW_S
            away from `now`, the signature does not match, or the nonce was used before.
    """
    stamp, nonce, signature = (headers.get(h) for h in (HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE))
    if not stamp or not nonce or not signature:
        raise AuthError(f"unsigned request: the cluster secret is required; {NO_SECRET_HINT}")
    try:
        when = float(stamp)
    except ValueError:
        raise AuthError(f"malformed {HEADER_TIMESTAMP} header {stamp[:40]!r}") from None
    if not abs(now - when) <= MAX_SKEW_S:  # NOTE: also refuses nan
        raise AuthError(f"request timestamp is {now - when:+.1f} s off this host's clock (limit {MAX_SKEW_S} s)")
    expected = _request_mac(secret, method, path_with_query, body, stamp, nonce)
    if not hmac.compare_digest(signature.encode(errors="replace"), expected.encode()):
        raise AuthError("bad request signature: wrong cluster secret, or the request was altered")
    cache = _DEFAULT_REPLAY_CACHE if replay_cache is None else replay_cache
    if not cache.admit(nonce, when, now):
        raise AuthError("replayed request: this nonce was already used")
