"""Request signing: only members of a swarm, who share its secret, are served.

Every request but the open ones (``GET /health``, ``GET /metrics``) carries three headers:

    X-Swarm-Timestamp  seconds since the epoch, as a decimal string
    X-Swarm-Nonce      16 to 64 characters of [A-Za-z0-9_-], new for every request
    X-Swarm-Signature  hex HMAC-SHA256(secret, METHOD \\n PATH?QUERY \\n TIMESTAMP \\n NONCE \\n hex SHA-256(body))

The server refuses (401, JSON error, one ``auth.refused`` log line) a request that is
unsigned, whose signature does not match (forged, altered, or another swarm's secret),
whose timestamp is further than ``max_skew_s`` from its clock (expired, or from the
future), or whose nonce it already saw (a replay). A nonce is remembered as long as its
timestamp could still pass the skew check, so memory is bounded by the request rate times
``2 * max_skew_s``; past ``max_nonces`` the oldest are forgotten and every timestamp up to
theirs is refused from then on, so a forgotten nonce cannot be replayed either. The secret
itself never travels.

Clients sign in an aiohttp client middleware (:func:`signing_middleware`), so every call
site that uses a swarm session signs without knowing it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from aiohttp import ClientHandlerType, ClientRequest, ClientResponse, web

from shared.errors import PayloadTooLarge, SwarmError

TIMESTAMP, NONCE, SIGNATURE = "X-Swarm-Timestamp", "X-Swarm-Nonce", "X-Swarm-Signature"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # GET only: probes and scrapers hold no secret
MIN_SECRET_LEN = 16
_NONCE = re.compile(r"[A-Za-z0-9_-]{16,64}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")


class Unauthorized(SwarmError):
    status = 401
    code = "unauthorized"


def load_secret(secret: str = "", secret_file: str = "") -> bytes | None:
    """The swarm's secret from a value or a file (one of them; surrounding whitespace
    dropped); None when neither is set (signing off). Too short a secret is refused."""
    if secret and secret_file:
        raise ValueError("set SWARM_SECRET or SWARM_SECRET_FILE, not both")
    if secret_file:
        try:
            secret = Path(secret_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"SWARM_SECRET_FILE={secret_file!r}: {exc.strerror or exc}") from None
        if not secret:
            raise ValueError(f"SWARM_SECRET_FILE={secret_file!r} is empty")
    if not secret:
        return None
    if len(secret) < MIN_SECRET_LEN:
        raise ValueError(
            f"the swarm secret must be at least {MIN_SECRET_LEN} characters (e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`)"
        )
    return secret.encode()


def signature(secret: bytes, method: str, path_qs: str, timestamp: str, nonce: str, body: bytes) -> str:
    message = "\n".join((method.upper(), path_qs, timestamp, nonce, hashlib.sha256(body).hexdigest()))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def sign_headers(
    secret: bytes, method: str, path_qs: str, body: bytes, *, now: float | None = None, nonce: str | None = None
) -> dict[str, str]:
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = nonce or secrets.token_urlsafe(18)
    return {TIMESTAMP: timestamp, NONCE: nonce, SIGNATURE: signature(secret, method, path_qs, timestamp, nonce, body)}


def signing_middleware(secret: bytes):
    """aiohttp client middleware: signs every request of the session it is given to."""

    async def sign(request: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        body = await request.body.as_bytes() if request.body else b""
        for name, value in sign_headers(secret, request.method, request.url.raw_path_qs, body).items():
            request.headers[name] = value
        return await handler(request)

    return sign


class Verifier:
    """Checks signed requests: signature, clock skew, replays (see the module docstring)."""

    def __init__(
        self,
        secret: bytes,
        *,
        max_skew_s: float = 30.0,
        max_nonces: int = 1_000_000,
        clock: Callable[[], float] = time.time,
    ):
        self.secret, self.max_skew_s, self.max_nonces, self.clock = secret, max_skew_s, max_nonces, clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> timestamp, oldest first
        self._horizon = float("-inf")  # timestamps at or before this are refused (their nonces were forgotten)

    def verify(self, method: str, path_qs: str, headers, body: bytes) -> None:
        """Return if the request is signed, fresh and new; else raise :class:`Unauthorized`."""
        timestamp, nonce, sig = headers.get(TIMESTAMP), headers.get(NONCE), headers.get(SIGNATURE)
        if timestamp is None or nonce is None or sig is None:
            raise Unauthorized(f"unsigned request: {TIMESTAMP}, {NONCE} and {SIGNATURE} are required")
        try:
            ts = float(timestamp)
        except ValueError:
            raise Unauthorized(f"{TIMESTAMP} is not a number") from None
        if not _NONCE.fullmatch(nonce) or not _SIGNATURE.fullmatch(sig):
            raise Unauthorized(f"malformed {NONCE} or {SIGNATURE}")
        if not hmac.compare_digest(sig, signature(self.secret, method, path_qs, timestamp, nonce, body)):
            raise Unauthorized("bad signature (another swarm's secret, or an altered request)")
        now = self.clock()
        if not abs(now - ts) <= self.max_skew_s:  # also refuses NaN and infinities
            raise Unauthorized(
                f"timestamp {timestamp} is {now - ts:+.1f} s from this server's clock (at most {self.max_skew_s:g} s)"
            )
        if nonce in self._seen or ts <= self._horizon:
            raise Unauthorized("replayed request (nonce already used)")
        self._remember(nonce, ts, now)

    def _remember(self, nonce: str, ts: float, now: float) -> None:
        self._seen[nonce] = ts
        while self._seen:  # forget what can no longer pass the skew check (insertion order ~ time order)
            oldest, oldest_ts = next(iter(self._seen.items()))
            if oldest_ts < now - self.max_skew_s:
                del self._seen[oldest]
            elif len(self._seen) > self.max_nonces:
                del self._seen[oldest]
                self._horizon = max(self._horizon, oldest_ts)
            else:
                break


def auth_middleware(verifier: Verifier, log, open_paths: frozenset[str] = OPEN_PATHS):
    """aiohttp server middleware: refuses what :class:`Verifier` refuses, logs each refusal."""

    @web.middleware
    async def check(request: web.Request, handler):
        if not (request.method in ("GET", "HEAD") and request.path in open_paths):
            try:
                body = (
                    await request.read() if request.body_exists else b""
                )  # read once: aiohttp keeps it for the handler
            except web.HTTPRequestEntityTooLarge:
                raise PayloadTooLarge(
                    f"body exceeds this server's limit of {request.app._client_max_size} bytes"
                ) from None
            try:
                verifier.verify(request.method, request.rel_url.raw_path_qs, request.headers, body)
            except Unauthorized as exc:
                log.warning(
                    "auth.refused", method=request.method, path=request.path, remote=request.remote, reason=exc.message
                )
                raise
        return await handler(request)

    return check
