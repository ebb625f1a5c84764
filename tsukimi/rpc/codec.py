"""Framing of control-plane messages: msgspec Structs <-> msgpack bytes.

A service declares its requests and responses as msgspec `Struct`s with `tag=True`, so
that one frame decodes straight into the right class (a tagged union). Every response
union also holds `ErrorReply`, the wire form of a `TsukimiError`: (code, message), raised
again as the same class on the calling side (`tsukimi.errors.error_from_code`).

Nothing here touches sockets; `RpcServer` and `RpcClient` carry the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Union

import msgspec

from tsukimi.errors import ConfigError, ProtocolError

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 << 20

Buffer = bytes | bytearray | memoryview


class ErrorReply(msgspec.Struct, tag=True, frozen=True):
    """A failed call on the wire: the error's `code` and its message."""

    code: str
    message: str


def _check_tagged(types: Sequence[type[msgspec.Struct]], what: str) -> tuple[type[msgspec.Struct], ...]:
    if not types:
        raise ConfigError(f"a codec needs at least one {what} type")
    for cls in types:
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            raise ConfigError(f"{what} type {cls!r} is not a msgspec.Struct")
        if cls.__struct_config__.tag is None:
            raise ConfigError(f"{what} type {cls.__name__} must be declared with tag=True")
    return tuple(types)


def _union_decoder(types: tuple[type[msgspec.Struct], ...], what: str) -> msgspec.msgpack.Decoder[msgspec.Struct]:
    # NOTE: Union[...] of a runtime tuple is how msgspec takes a tagged union; with one
    # member it collapses to that class, whose tag msgspec still checks. Every member is a
    # Struct (checked above), so the decoder yields Structs.
    try:
        decoder: msgspec.msgpack.Decoder[msgspec.Struct] = msgspec.msgpack.Decoder(Union[types])  # noqa: UP007
        return decoder
    except TypeError as exc:  # e.g. two types share a tag
        raise ConfigError(f"invalid {what} types: {exc}") from exc


class Codec:
    """Encodes messages and decodes request and response frames of one service.

    Args:
        request_types: the tagged Structs a server accepts.
        response_types: the tagged Structs a server answers with (`ErrorReply` is added).
        max_frame_bytes: frames longer than this are refused on encode and on decode.

    Raises:
        ConfigError: a type is not a tagged Struct, tags collide, or the limit is not positive.
    """

    def __init__(
        self,
        request_types: Sequence[type[msgspec.Struct]],
        response_types: Sequence[type[msgspec.Struct]],
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.request_types = _check_tagged(request_types, "request")
        self.response_types = _check_tagged(response_types, "response")
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = _union_decoder(self.request_types, "request")
        self._response_decoder = _union_decoder((*self.response_types, ErrorReply), "response")

    def encode(self, obj: msgspec.Struct) -> bytes:
        """Encode one message (request, response or `ErrorReply`); pure.

        Raises:
            ProtocolError: the encoded frame exceeds `max_frame_bytes`.
        """
        data = self._encoder.encode(obj)
        if len(data) > self.max_frame_bytes:
            raise ProtocolError(
                f"{type(obj).__name__} encodes to {len(data)} bytes, over the {self.max_frame_bytes}-byte frame limit"
            )
        return data

    def decode_request(self, data: Buffer) -> msgspec.Struct:
        """Decode a request frame into one of `request_types`; pure.

        Raises:
            ProtocolError: oversized, malformed, or not one of the declared requests.
        """
        return self._decode(self._request_decoder, data, "request")

    def decode_response(self, data: Buffer) -> msgspec.Struct:
        """Decode a response frame into one of `response_types` or an `ErrorReply`; pure.

        Raises:
            ProtocolError: oversized, malformed, or not one of the declared responses.
        """
        return self._decode(self._response_decoder, data, "response")

    def _decode(self, decoder: msgspec.msgpack.Decoder[msgspec.Struct], data: Buffer, what: str) -> msgspec.Struct:
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        if size > self.max_frame_bytes:
            raise ProtocolError(f"{what} frame of {size} bytes exceeds the {self.max_frame_bytes}-byte limit")
        try:
            return decoder.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            # NOTE: ValidationError is a DecodeError; msgspec raises UnicodeDecodeError itself for
            # a str that is not UTF-8 (found by tests/fuzz), and RecursionError for deep nesting.
            raise ProtocolError(f"malformed {what} frame ({size} bytes): {exc}") from exc
