"""The pool's gRPC service for Serve's gRPC ingress, written by hand: raw bytes in
and out, the same request body and frames as over HTTP (engine/cluster/pool_protocol.py)."""

from __future__ import annotations

GRPC_SERVICE = "voxgate.EnginePool"
GRPC_SERVICER = "voxgate.engine.cluster.pool_grpc:add_EnginePoolServicer_to_server"


class RawMessage:
    """What a Serve replica hands back over gRPC: it calls SerializeToString on each message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data


def add_EnginePoolServicer_to_server(servicer, server) -> None:  # noqa: N802 (the name gRPC codegen would give)
    """The pool's gRPC service for Serve's `grpc_servicer_functions`, written by hand
    instead of generated: requests and responses are raw bytes (no serializers), the
    same StreamRequest body and frames as the HTTP ingress.

        /voxgate.EnginePool/Stats   b""            -> the replica's stats as JSON
        /voxgate.EnginePool/Stream  StreamRequest  -> frames, one message each
    """
    import grpc

    handlers = {
        "Stats": grpc.unary_unary_rpc_method_handler(servicer.Stats),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.Stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
