"""The errors of `dgemma serve`, in OpenAI's shape: `APIError` (an HTTP status and OpenAI's error object naming the
field), the 429 of a full server, and the small helpers the request rules word their messages with. Its own module
because every other serving module (api, app, choice, formats, guards, scoring, the adapter routes) raises them."""

from __future__ import annotations

import json
from typing import Any


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error object."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type
        self.headers = headers  # of the response (`Connection: close` where the rest of the request is not read)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


RETRY_AFTER_S = 1  # what a 429 tells the client to wait: a canvas of the models served here takes well under that


def rate_limited(message: str) -> APIError:
    """The 429 of a full server: OpenAI's rate-limit error object and a Retry-After header."""
    return APIError(message, status=429, code="rate_limit_exceeded", type="requests",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def model_not_found(model: Any, served: tuple[str, ...]) -> APIError:
    """The 404 of a `model` the server does not serve, naming the models it does (the base model's name, then its
    adapters')."""
    return APIError(f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                    param="model", status=404, code="model_not_found")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def as_list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise APIError(f"{where}: must be a list, got {short(v)}", param=where.split("[")[0].split(".")[0])
    return v


def short(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, bytes) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
