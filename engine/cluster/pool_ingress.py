"""The Serve deployment's class (engine/cluster/pool.py deploys it): HTTP in (and Serve's gRPC,
through engine/cluster/pool_grpc.py), a streamed body of frames out, from the replica's
EngineHost (engine/cluster/pool_host.py)."""

from __future__ import annotations

import json

from ...logs import setup_logging
from ..base import SynthesisOptions
from ..runtime.codec import pack_frame
from .pool_grpc import RawMessage
from .pool_host import EngineHost, PoolConfig
from .pool_protocol import (
    INFO_PATH, MAX_REQUEST_BYTES, REPLICA_HEADER, REPLICAS_PATH, STATS_PATH, STREAM_PATH, PoolProtocolError,
    StreamRequest,
)
from .pool_replicas import ReplicaListing


class PoolIngress:
    """The Serve deployment's class: HTTP in, a streamed body of frames out."""

    def __init__(self, config: PoolConfig) -> None:
        setup_logging(config.log_level)
        self.host = EngineHost(config)
        self.listing = ReplicaListing()

    # Serve's gRPC ingress (start_local's grpc_port): the same bytes as over HTTP.
    async def Stats(self, request: bytes) -> "RawMessage":
        return RawMessage(json.dumps(self.host.stats()).encode())

    async def Stream(self, request: bytes):
        """A StreamRequest body in, frames out; a bad request is one `error` frame."""
        try:
            stream_request = StreamRequest.decode(bytes(request))
            SynthesisOptions.from_dict(stream_request.options)
        except (PoolProtocolError, ValueError, TypeError) as exc:
            yield RawMessage(pack_frame({"kind": "error", "message": str(exc)[:500]}))
            return
        async for frame in self.host.stream(stream_request):
            yield RawMessage(frame)

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        path = request.url.path.rstrip("/")
        root = request.scope.get("root_path", "").rstrip("/")  # the app's route prefix, when it is not "/"
        if root and path.startswith(root):
            path = path[len(root):]
        if request.method == "GET" and path == INFO_PATH:
            return JSONResponse(self.host.info)
        if request.method == "GET" and path == STATS_PATH:
            return JSONResponse(self.host.stats())
        if request.method == "GET" and path == REPLICAS_PATH:
            return JSONResponse(await self.listing.get())
        if request.method != "POST" or path != STREAM_PATH:
            return JSONResponse({"error": "not_found", "message": f"use POST {STREAM_PATH}"}, status_code=404)
        try:
            body = await _read_capped(request)
            stream_request = StreamRequest.decode(body)
            SynthesisOptions.from_dict(stream_request.options)
        except (PoolProtocolError, ValueError, TypeError) as exc:
            return JSONResponse({"error": "bad_request", "message": str(exc)}, status_code=400)
        return StreamingResponse(
            self.host.stream(stream_request), media_type="application/octet-stream",
            headers={REPLICA_HEADER: self.host.replica_id},
        )

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            host.close()


async def _read_capped(request) -> bytes:
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_REQUEST_BYTES:
            raise PoolProtocolError(f"request body over {MAX_REQUEST_BYTES} bytes")
    return bytes(body)
