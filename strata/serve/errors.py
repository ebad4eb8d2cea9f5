"""API errors in each protocol's own JSON shape.

OpenAI (Chat Completions, Completions, Responses, models):
  {"error": {"message": ..., "type": ..., "param": null, "code": ...}}
Anthropic (Messages):
  {"type": "error", "error": {"type": ..., "message": ...}}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# kind → (HTTP status, OpenAI type, OpenAI code, Anthropic type)
KINDS = {
    "invalid_request": (400, "invalid_request_error", None, "invalid_request_error"),
    "authentication": (401, "authentication_error", "invalid_api_key", "authentication_error"),
    "not_found": (404, "invalid_request_error", "model_not_found", "not_found_error"),
    "too_large": (413, "invalid_request_error", "request_too_large", "request_too_large"),
    "rate_limit": (429, "rate_limit_error", "rate_limit_exceeded", "rate_limit_error"),
    "server": (500, "server_error", None, "api_error"),
    "unavailable": (503, "server_error", "unavailable", "overloaded_error"),
}


@dataclass
class ApiError(Exception):
    kind: str
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    status: int | None = None  # overrides the kind's status (e.g. a recipe error's own)
    counted: bool = False      # already in /metrics' request outcomes (rejected, error)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown API error kind {self.kind!r}")
        super().__init__(self.message)

    @property
    def status_code(self) -> int:
        return self.status or KINDS[self.kind][0]

    def body(self, style: str) -> dict:
        _, oa_type, oa_code, an_type = KINDS[self.kind]
        if style == "anthropic":
            return {"type": "error", "error": {"type": an_type, "message": self.message}}
        return {"error": {"message": self.message, "type": oa_type, "param": self.param,
                          "code": self.code or oa_code}}


def from_conversion_error(e: Exception) -> ApiError:
    """A deepseek-recipe ConversionError (status_code + OpenAI-shaped body) as an ApiError."""
    status = int(getattr(e, "status_code", 400))
    message, param, code = str(e), None, None
    try:
        err = json.loads(getattr(e, "body", ""))["error"]
        message, param, code = err.get("message", message), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        pass
    kind = {401: "authentication", 404: "not_found", 413: "too_large",
            429: "rate_limit"}.get(status, "invalid_request" if status < 500 else "server")
    if code == "invalid_request_error":  # recipe repeats the type as the code
        code = None
    return ApiError(kind, message, param=param, code=code, status=status)
