"""The msgpack-over-HTTP edge shared by every service and client.

Server side: one error middleware that maps domain errors (and aiohttp's own 404/405/413)
to JSON ``{"error": {"code", "message"}}``; reading a msgpack request with content-type
and size checks; answering with msgpack. Client side: one POST helper with a timeout
that turns every failure into :class:`RemoteError`.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from shared.codec import pack_message, unpack_message
from shared.errors import PayloadTooLarge, RemoteError, SwarmError, UnsupportedMediaType

MSGPACK = "application/msgpack"
JSON = "application/json"


def error_middleware(log):
    """Every refusal becomes a JSON error with a fitting status; nothing else escapes."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except SwarmError as exc:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s else None
            log.info("request.refused", path=request.path, status=exc.status, code=exc.code, reason=exc.message)
            return web.json_response(exc.to_json(), status=exc.status, headers=headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {413: "payload_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
            return web.json_response({"error": {"code": code, "message": exc.reason}}, status=exc.status)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: log it whole, answer 500, keep serving
            log.exception("request.crashed", path=request.path, error=repr(exc))
            return web.json_response({"error": {"code": "internal", "message": repr(exc)}}, status=500)

    return middleware


async def read_body(request: web.Request, content_type: str, max_bytes: int, setting: str = "SWARM_MAX_BODY_MB") -> bytes:
    """Read a request body, refusing another content type (415) and oversize bodies (413)."""
    if request.content_type != content_type:
        raise UnsupportedMediaType(f"expected Content-Type {content_type}, got {request.content_type or 'none'!r}")
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(f"body of {request.content_length} bytes exceeds the limit of {max_bytes} (setting {setting})")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"body exceeds the limit of {max_bytes} bytes (setting {setting})") from None


async def read_message(request: web.Request, max_bytes: int) -> dict:
    """Read a msgpack message (see :func:`read_body` for the refusals)."""
    return unpack_message(await read_body(request, MSGPACK, max_bytes))


def msgpack_response(msg: dict) -> web.Response:
    return web.Response(body=pack_message(msg), content_type=MSGPACK)


async def request_bytes(session: aiohttp.ClientSession, method: str, url: str, *, expect: str, timeout_s: float, data: bytes | None = None, content_type: str | None = None) -> bytes:
    """One HTTP request whose 200 reply must have Content-Type ``expect``; returns the body.

    Any failure (transport, timeout, an error status with its JSON error, another content
    type) raises :class:`RemoteError`.
    """
    headers = {"Content-Type": content_type} if content_type else None
    try:
        async with session.request(method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            payload = await resp.read()
            if resp.status != 200:
                raise RemoteError(url, resp.status, *_error_of(payload, resp.reason))
            if resp.content_type != expect:
                raise RemoteError(url, resp.status, "bad_reply", f"reply has Content-Type {resp.content_type!r}")
            return payload
    except asyncio.TimeoutError:
        raise RemoteError(url, None, "timeout", f"no reply within {timeout_s} s") from None
    except aiohttp.ClientError as exc:
        raise RemoteError(url, None, "unreachable", repr(exc)) from None


async def post_message(session: aiohttp.ClientSession, url: str, msg: dict, *, timeout_s: float, body: bytes | None = None) -> dict:
    """POST a message and return the decoded reply; any failure raises :class:`RemoteError`."""
    data = pack_message(msg) if body is None else body
    payload = await request_bytes(session, "POST", url, expect=MSGPACK, timeout_s=timeout_s, data=data, content_type=MSGPACK)
    try:
        return unpack_message(payload)
    except SwarmError as exc:
        raise RemoteError(url, 200, "bad_reply", exc.message) from None


async def get_json(session: aiohttp.ClientSession, url: str, *, timeout_s: float) -> dict:
    """GET a JSON object (a control-plane view); any failure raises :class:`RemoteError`."""
    return _json_object(url, await request_bytes(session, "GET", url, expect=JSON, timeout_s=timeout_s))


async def post_json(session: aiohttp.ClientSession, url: str, body: dict, *, timeout_s: float) -> dict:
    """POST a JSON control message and return the JSON object answered; failures raise :class:`RemoteError`."""
    data = json.dumps(body, allow_nan=False).encode()
    return _json_object(url, await request_bytes(session, "POST", url, expect=JSON, timeout_s=timeout_s, data=data, content_type=JSON))


def _json_object(url: str, payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise RemoteError(url, 200, "bad_reply", f"reply is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RemoteError(url, 200, "bad_reply", "reply is not a JSON object")
    return value


def _error_of(payload: bytes, reason: str | None) -> tuple[str, str]:
    """(code, message) of a JSON error reply, or the best description of another body."""
    try:
        err = json.loads(payload)["error"]
        return str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        return "http_error", reason or payload[:200].decode("utf-8", "replace")
