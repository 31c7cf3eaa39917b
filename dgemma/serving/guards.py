"""What `dgemma serve` checks before it parses a request (docs/serving.md, Limits and refusals): the API key's own
rule, the Host header (DNS rebinding), the JSON content type (cross-site "simple" requests), the request head (its
line and headers) and the body, each read under a time limit (a client that sends it slowly cannot hold the server),
the body under a size cap too. Every refusal is OpenAI's
error object with its HTTP status.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from dgemma.serving.errors import APIError, error_body

LOOPBACK = "loopback"  # an allowed-hosts entry: localhost, 127.0.0.0/8 and ::1, any port
ANY_HOST = "*"


def check_api_key(key: str | None) -> None:
    """Refuse an API key that would not protect anything: an empty one (an empty Bearer token would match it), or
    one with spaces, control or non-ASCII characters (it cannot be sent as a header value as written)."""
    if key is None:
        return
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"--api-key: must be a non-empty string of printable ASCII without spaces, got {key!r}")


def is_loopback(host: str) -> bool:
    """Whether a bind address or a Host name (no port) is this machine only: localhost, 127.x.x.x, ::1."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, api_key: str | None, extra: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers (None: any). A server on a loopback address without
    an API key answers only loopback names, so that a web page cannot reach it through a DNS name rebound to
    127.0.0.1; `extra` (`--allowed-hosts`) adds names, and `*` allows any."""
    if ANY_HOST in extra:
        return None
    if extra:
        return (LOOPBACK, *(h.strip().lower().rstrip(".") for h in extra))
    return (LOOPBACK,) if is_loopback(bind_host) and api_key is None else None


def host_name(header: str) -> str:
    """The name of a Host header, without its port (`[::1]:8000` -> `::1`, `Example.com.:80` -> `example.com`)."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    return (h.rsplit(":", 1)[0] if h.count(":") == 1 else h).rstrip(".")


class HostCheck:
    """ASGI middleware: answers 403 to a request whose Host header is not one of `allowed` (see `allowed_hosts`)."""

    def __init__(self, app: Any, allowed: Sequence[str]):
        self.app, self.allowed = app, tuple(allowed)

    def allows(self, header: str | None) -> bool:
        if header is None:
            return False
        name = host_name(header)
        return any(is_loopback(name) if a == LOOPBACK else name == a for a in self.allowed)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.allows(header):
                shown = ", ".join("localhost, 127.x.x.x, [::1]" if a == LOOPBACK else a for a in self.allowed)
                message = (f"Host header {header!r} is not allowed: this server answers only {shown} (any port); "
                           "start it with --allowed-hosts NAME to add names, or --api-key to require a key instead")
                response = JSONResponse(error_body(message, code="host_not_allowed"), 403)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def require_json(request: Request) -> None:
    """A POST body must say it is JSON: text/plain and form bodies are what a cross-site page may send without the
    browser asking first, so they are refused (415) rather than parsed."""
    header = request.headers.get("content-type", "")
    media, *params = (p.strip().lower() for p in header.split(";"))
    charset = next((p.split("=", 1)[1].strip('" ') for p in params if p.startswith("charset=")), "utf-8")
    if media != "application/json" or charset not in ("utf-8", "utf8"):
        raise APIError(f"Content-Type: must be application/json (UTF-8), got {header or 'none'!r}", status=415,
                       code="unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, at most `max_bytes` (else 413) within `timeout` seconds (else 408: a client trickling its
    body in cannot hold a connection, or a place among the requests in flight, for longer)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s (--body-timeout)", status=408,
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise APIError("the client closed the connection before the whole request body arrived") from None


def _too_large(max_bytes: int) -> APIError:
    return APIError(f"the request body is larger than {max_bytes:,} bytes (--max-request-bytes)", status=413,
                    code="request_too_large")


# --- the request head ----------------------------------------------------------------------------------------------

def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with a deadline on each request's head: the request line and headers must arrive
    within `seconds` of the connection opening, or of the first byte of a later request on it; else the server
    answers 408 (OpenAI's error object) and closes the connection. (uvicorn has no such limit: `timeout_keep_alive`
    ends only idle connections between requests, `h11_max_incomplete_event_size` caps the head's size, not its
    time, so a head sent a byte a minute held a connection forever.) The body has its own limit (`read_body`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    late = json.dumps(error_body(f"the request line and headers did not arrive within {seconds:g} s "
                                 "(--header-timeout)", code="request_timeout")).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(late), late))

    class HeaderTimeoutProtocol(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.head_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first byte of a later request on the connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in: a request (or an error) is under way
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.head_timer is None and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] \
                    and not self.transport.is_closing():
                self._arm()  # part of the next request's head came with the last one (pipelined)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self.head_timer = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _late(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return HeaderTimeoutProtocol
