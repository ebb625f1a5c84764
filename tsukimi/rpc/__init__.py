"""Control-plane RPC: msgspec Struct messages, one request/reply frame each way over TCP.

A service declares tagged msgspec Structs for its requests and responses, builds one
`Codec` from them, serves a handler with `RpcServer` and calls it with `RpcClient`.
Errors raised by the handler cross the wire as `ErrorReply(code, message)` and are raised
again on the caller as the same `TsukimiError` class. Given the cluster secret
(`secret=`), server and client authenticate each connection both ways (tsukimi/auth.py).

    codec = Codec([GetRequest], [GetResponse])
    with RpcServer(codec, handle) as server, RpcClient(codec, server.endpoint) as client:
        response = client.call_as(GetRequest(key="k"), GetResponse)
"""

from __future__ import annotations

from tsukimi.rpc.client import NO_RETRY, UNSENT_RETRY, RpcClient
from tsukimi.rpc.codec import DEFAULT_MAX_FRAME_BYTES, Codec, ErrorReply
from tsukimi.rpc.server import Handler, RpcServer

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "NO_RETRY",
    "UNSENT_RETRY",
    "Codec",
    "ErrorReply",
    "Handler",
    "RpcClient",
    "RpcServer",
]
