"""The msgpack-over-HTTP edge shared by every service and client.

Server side: one error middleware that maps domain errors (and aiohttp's own 404/405/413)
to JSON ``{"error": {"code", "message"}}``; reading a msgpack request with content-type
and size checks; answering with msgpack. Client side: one POST helper with a timeout
that turns every failure into :class:`RemoteError`.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import aiohttp
import structlog
from aiohttp import web

from shared.codec import pack_message, unpack_message
from shared.errors import BadPayload, PayloadTooLarge, RemoteError, SwarmError, UnsupportedMediaType, WrongRun

T = TypeVar("T")
MIN_RETRY_WAIT_S = 0.1  # a Retry-After of 0 still waits this long before asking again

MSGPACK = "application/msgpack"
JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
MICROBATCH_HEADER = "X-Swarm-Microbatch"  # the trainer's microbatch id, bound in the receiver's log lines
MAX_MICROBATCH_HEADER_LEN = 128


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


def request_log_middleware(log):
    """Binds the request's microbatch id (header ``X-Swarm-Microbatch``) to every line logged
    while it is handled, and logs one ``request.done`` line (debug level) per request, so
    ``SWARM_LOG_LEVEL=debug`` follows a microbatch from the trainer through every stage."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        microbatch = request.headers.get(MICROBATCH_HEADER, "")[:MAX_MICROBATCH_HEADER_LEN]
        with structlog.contextvars.bound_contextvars(**({"microbatch": microbatch} if microbatch else {})):
            started, status = time.perf_counter(), 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            finally:
                log.debug(
                    "request.done",
                    method=request.method,
                    path=request.path,
                    status=status,
                    seconds=round(time.perf_counter() - started, 6),
                )

    return middleware


async def read_body(
    request: web.Request, content_type: str, max_bytes: int, setting: str = "SWARM_MAX_BODY_MB"
) -> bytes:
    """Read a request body, refusing another content type (415) and oversize bodies (413)."""
    if request.content_type != content_type:
        raise UnsupportedMediaType(f"expected Content-Type {content_type}, got {request.content_type or 'none'!r}")
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(
            f"body of {request.content_length} bytes exceeds the limit of {max_bytes} (setting {setting})"
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"body exceeds the limit of {max_bytes} bytes (setting {setting})") from None


async def read_json(request: web.Request, max_bytes: int, setting: str) -> dict:
    """Read a JSON object (see :func:`read_body` for the refusals; 400 if it is no JSON object)."""
    body = await read_body(request, JSON, max_bytes, setting=setting)
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadPayload(f"body is not valid JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise BadPayload("body must be a JSON object")
    return msg


def check_run(msg: dict, expected: str) -> None:
    """:class:`WrongRun` unless the message's ``run_id`` is ``expected`` (400 if it has none)."""
    run_id = msg.get("run_id")
    if not isinstance(run_id, str):
        raise BadPayload("'run_id' must be a string")
    if run_id != expected:
        raise WrongRun(f"this coordinator runs {expected!r}, not {run_id!r} (setting SWARM_RUN_ID)")


async def read_message(request: web.Request, max_bytes: int) -> dict:
    """Read a msgpack message (see :func:`read_body` for the refusals)."""
    return unpack_message(await read_body(request, MSGPACK, max_bytes))


def msgpack_response(msg: dict) -> web.Response:
    return web.Response(body=pack_message(msg), content_type=MSGPACK)


async def request_bytes(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    expect: str,
    timeout_s: float,
    data: bytes | None = None,
    content_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    """One HTTP request whose 200 reply must have Content-Type ``expect``; returns the body.

    Any failure (transport, timeout, an error status with its JSON error, another content
    type) raises :class:`RemoteError`.
    """
    headers = {**(headers or {}), **({"Content-Type": content_type} if content_type else {})} or None
    try:
        async with session.request(
            method, url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            payload = await resp.read()
            if resp.status != 200:
                code, message, details = _error_of(payload, resp.reason)
                raise RemoteError(
                    url,
                    resp.status,
                    code,
                    message,
                    retry_after_s=_retry_after(resp.headers.get("Retry-After")),
                    details=details,
                )
            if resp.content_type != expect:
                raise RemoteError(url, resp.status, "bad_reply", f"reply has Content-Type {resp.content_type!r}")
            return payload
    except asyncio.TimeoutError:
        raise RemoteError(url, None, "timeout", f"no reply within {timeout_s} s") from None
    except aiohttp.ClientError as exc:
        refused = isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)
        raise RemoteError(url, None, "unreachable", repr(exc), refused=refused) from None


async def post_message(
    session: aiohttp.ClientSession,
    url: str,
    msg: dict,
    *,
    timeout_s: float,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> dict:
    """POST a message and return the decoded reply; any failure raises :class:`RemoteError`."""
    data = pack_message(msg) if body is None else body
    payload = await request_bytes(
        session, "POST", url, expect=MSGPACK, timeout_s=timeout_s, data=data, content_type=MSGPACK, headers=headers
    )
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
    return _json_object(
        url, await request_bytes(session, "POST", url, expect=JSON, timeout_s=timeout_s, data=data, content_type=JSON)
    )


async def from_any_replica(
    urls: Sequence[str],
    fetch: Callable[[str], Awaitable[T]],
    *,
    deadline_s: float,
    on_error: Callable[[str, RemoteError], None],
) -> T | None:
    """``fetch(url)`` from the first of ``urls`` that answers, or None. A replica that
    refused as overloaded (503 ``overloaded`` with Retry-After: its compute queue was
    full) is asked again after the delay it gave, while ``deadline_s`` lasts; any other
    failure rules it out. Each failure goes to ``on_error``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    pending = list(urls)
    while pending:
        busy: list[tuple[str, float]] = []
        for url in pending:
            try:
                return await fetch(url)
            except RemoteError as exc:
                on_error(url, exc)
                if exc.code == "overloaded" and exc.retry_after_s is not None:
                    busy.append((url, max(MIN_RETRY_WAIT_S, exc.retry_after_s)))
        if not busy:
            return None
        wait = min(delay for _, delay in busy)
        if loop.time() + wait >= deadline:
            return None
        await asyncio.sleep(wait)
        pending = [url for url, _ in busy]
    return None


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delta form; an HTTP date or junk counts as absent)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None


def _json_object(url: str, payload: bytes) -> dict:
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise RemoteError(url, 200, "bad_reply", f"reply is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RemoteError(url, 200, "bad_reply", "reply is not a JSON object")
    return value


def _error_of(payload: bytes, reason: str | None) -> tuple[str, str, dict]:
    """(code, message, the error's other fields) of a JSON error reply, or the best
    description of another body."""
    try:
        err = json.loads(payload)["error"]
        return str(err["code"]), str(err["message"]), {k: v for k, v in err.items() if k not in ("code", "message")}
    except (ValueError, KeyError, TypeError):
        return "http_error", reason or payload[:200].decode("utf-8", "replace"), {}


# ------------------------------------------------------------------ security: signing and TLS
def server_ssl_context(settings) -> ssl.SSLContext | None:
    """The TLS context a service listens with (``tls_cert_file`` + ``tls_key_file``), or None."""
    if not settings.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"SWARM_TLS_CERT_FILE/SWARM_TLS_KEY_FILE: {exc}") from None
    return context


def client_ssl_context(settings) -> ssl.SSLContext | None:
    """What a client trusts: ``tls_ca_file`` (e.g. the swarm's self-signed certificate), else
    the system's certificates (None: aiohttp's default)."""
    if not settings.tls_ca_file:
        return None
    try:
        return ssl.create_default_context(cafile=settings.tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"SWARM_TLS_CA_FILE={settings.tls_ca_file!r}: {exc}") from None


def swarm_session(settings, *, limit: int = 100, **kwargs) -> aiohttp.ClientSession:
    """A client session of a swarm member: signs every request with the swarm secret (if
    set) and trusts ``tls_ca_file`` (if set). ``kwargs`` go to :class:`aiohttp.ClientSession`."""
    from shared.auth import signing_middleware

    secret = settings.secret_bytes()
    context = client_ssl_context(settings)
    connector = aiohttp.TCPConnector(limit=limit, ssl=context if context is not None else True)
    middlewares = (signing_middleware(secret),) if secret else ()
    return aiohttp.ClientSession(connector=connector, middlewares=middlewares, **kwargs)


def auth_middlewares(settings, log, *, open_paths: frozenset[str] | None = None) -> list:
    """The server middleware that refuses unsigned requests when the swarm has a secret
    (``[]`` when it has none); goes after :func:`error_middleware`, which formats its 401s."""
    from shared.auth import OPEN_PATHS, Verifier, auth_middleware

    secret = settings.secret_bytes()
    if not secret:
        return []
    return [auth_middleware(Verifier(secret, max_skew_s=settings.auth_max_skew_s), log, open_paths or OPEN_PATHS)]


def urlopen_swarm(
    settings,
    url: str,
    *,
    data: bytes | None = None,
    method: str = "GET",
    content_type: str | None = None,
    timeout_s: float = 5.0,
):
    """Blocking ``urllib`` request of a swarm member (CLI tools, the local supervisor):
    signed with the swarm secret and trusting ``tls_ca_file`` like :func:`swarm_session`."""
    import urllib.parse
    import urllib.request

    from shared.auth import sign_headers

    headers = {"Content-Type": content_type} if content_type else {}
    secret = settings.secret_bytes()
    if secret:
        parts = urllib.parse.urlsplit(url)
        path_qs = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers.update(sign_headers(secret, method, path_qs, data or b""))
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    return urllib.request.urlopen(request, timeout=timeout_s, context=client_ssl_context(settings))


# ------------------------------------------------------------------ listening
def check_can_listen(host: str, port: int) -> None:
    """Raise ValueError if a server cannot listen on ``host:port`` now: the port is taken, or
    ``host`` is no address of this machine. A server checks before it builds and joins its
    stage (minutes for a large one), instead of failing once it has; port 0 (any) passes.

    It binds a socket as asyncio's servers do (``SO_REUSEADDR``: a port whose last server
    left connections in TIME_WAIT is free) and closes it: the port can still be taken before
    the server binds it, and the server's own bind says so then (:func:`cannot_listen`)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise cannot_listen(host, port, exc) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds "::"
            try:
                s.bind(address)
            except OSError as exc:
                raise cannot_listen(host, port, exc) from None


def cannot_listen(host: str, port: int, exc: OSError) -> ValueError:
    """The error of a server that cannot listen on ``host:port``, naming the settings to change."""
    if exc.errno == errno.EADDRINUSE:
        why = "another process listens on it or holds it; set SWARM_PORT to a free port"
    else:
        why = f"{exc.strerror or exc}; SWARM_HOST must be an address of this machine"
    return ValueError(f"cannot listen on {host}:{port}: {why}")
