"""One mapping from every failure to an HTTP status and the OpenAI error JSON.

``{"error": {"message", "type", "param", "code"}}`` is what the ``openai`` SDK parses into
its ``APIStatusError`` subclasses; ``to_api_error`` is the only place that decides status.
"""

from __future__ import annotations

import json
import logging
import re

import msgspec
from aiohttp import web

from kvmem_core.errors import KVMemError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
log = logging.getLogger("kvmem.server")
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


class APIError(Exception):
    """An error with its HTTP status; ``headers`` carries e.g. ``Retry-After``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, dict[str, object]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_request") -> APIError:
    """A 400 for a request the schema accepted but the server cannot serve."""
    return APIError(400, message, code, param)


def engine_unavailable(message: str = "the engine is restarting; retry shortly") -> APIError:
    return APIError(503, message, "engine_unavailable", headers={"Retry-After": "2"})


def to_api_error(exc: BaseException) -> APIError:
    """The status, code and message for ``exc``; unknown exceptions become a bare 500 (and are logged)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        text = str(exc)
        match = _PATH.search(text)
        return APIError(400, text, "invalid_value", match.group(1) if match else None)
    if isinstance(exc, (msgspec.DecodeError, json.JSONDecodeError, UnicodeDecodeError)):
        return APIError(400, f"malformed JSON body: {exc}", "invalid_json")
    if isinstance(exc, KVMemError):
        return APIError(exc.http_status, str(exc), exc.code)
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return APIError(413, "request body too large", "body_too_large")
    if isinstance(exc, web.HTTPException):
        return APIError(exc.status, exc.reason, None)
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", "internal_error")


def error_response(exc: BaseException) -> web.Response:
    """The JSON response for ``exc``."""
    err = to_api_error(exc)
    return web.json_response(err.body(), status=err.status, headers=err.headers)
