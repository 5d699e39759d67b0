"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with vLLM's type names.

    handler raises ApiError(status, message, param) --app.py handler--> JSON error response
    middleware (before routing) --error_body()--> the same bytes
"""

from __future__ import annotations

import json
import re

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestEntityTooLargeError", 429: "RateLimitError",
               431: "RequestHeaderFieldsTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

_LEADING_NAME = re.compile(r"^([a-z_]+)\b")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json.dumps({"error": error}).encode()


def param_of(message: str, known: set[str]) -> str | None:
    """The parameter a validation message is about: the engine's messages start with its name
    ("temperature must be non-negative, got -1.0")."""
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in known else None
