"""Rebuilding a gRPC method handler around its behaviour, which each of the mesh's interceptors
does (errors to statuses, the access check, requests that do not parse): the four kinds of
handler in one place, so an interceptor says only what it wraps the behaviour in."""

from __future__ import annotations

from collections.abc import Callable

import grpc

# (handler attribute, constructor, the client streams, the server streams)
_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False, False),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, True, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, False, True),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True, True),
)

# wrap(behavior, client_streams, server_streams) -> the new behavior; a server-streaming one must
# be a generator, so that what it catches includes errors raised while the responses are made.
Wrap = Callable[[Callable, bool, bool], Callable]


def rewrapped(handler: grpc.RpcMethodHandler, wrap: Wrap, *, request_deserializer: Callable | None = None,
              response_serializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` whose behaviour is ``wrap``'s."""
    for attribute, make, client_streams, server_streams in _KINDS:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(wrap(behavior, client_streams, server_streams),
                        request_deserializer=request_deserializer or handler.request_deserializer,
                        response_serializer=response_serializer or handler.response_serializer)
    raise ValueError(f"a method handler without a behaviour: {handler!r}")
