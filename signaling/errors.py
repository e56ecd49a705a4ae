"""HTTP errors as the API reports them: JSON `{"error": {"code", "message"}}` with a status."""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def response(self) -> web.Response:
        return error_response(self.status, self.code, self.message)


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def read_json_object(request: web.Request, limit: int, hint: str = "") -> dict:
    """The request body as a JSON object, refusing oversized, non-UTF-8 and non-JSON bodies."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "too_large", f"request body is over {limit} bytes")
    raw = await request.content.read(limit + 1)
    if len(raw) > limit:
        raise ApiError(413, "too_large", f"request body is over {limit} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "request body is not valid UTF-8") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise ApiError(400, "invalid_json", "request body is not JSON" + (f"; {hint}" if hint else "")) from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    return body
