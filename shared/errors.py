"""Domain errors shared by every service, each with the HTTP status it maps to.

A handler raises these; one middleware per service turns them into
``{"error": {"code": ..., "message": ...}}`` with the status below.
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base class: a request that the service refuses, with a stable error code."""

    status = 500
    code = "internal"

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


class BadPayload(SwarmError):
    """Malformed body, wrong dtype or shape, non-finite values, out-of-range ids."""

    status = 400
    code = "bad_payload"


class WrongStage(SwarmError):
    """The request is for another stage (or another run) than this server holds."""

    status = 409
    code = "wrong_stage"


class WrongRun(SwarmError):
    """The request belongs to another run than the one this service takes part in."""

    status = 409
    code = "wrong_run"


class PayloadTooLarge(SwarmError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(SwarmError):
    status = 415
    code = "unsupported_media_type"


class Overloaded(SwarmError):
    """The compute queue is full; the client should retry later or elsewhere."""

    status = 503
    code = "overloaded"


class Draining(SwarmError):
    """The server is shutting down: it finishes what it accepted and takes nothing new."""

    status = 503
    code = "draining"


class RemoteError(Exception):
    """A peer answered with an error (or not at all); raised on the client side."""

    def __init__(
        self,
        url: str,
        status: int | None,
        code: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        details: dict | None = None,
        refused: bool = False,
    ):
        super().__init__(f"{url}: {status} {code}: {message}")
        self.refused = refused  # nothing listens at the address (connection refused): the peer's process is gone
        self.retry_after_s = retry_after_s  # the peer's Retry-After (503: when to come back)
        self.details = details or {}  # the error's other fields (e.g. a broken chain's ``failed`` replicas)
        self.url = url
        self.status = status
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Worth trying on another replica: transport failures, 5xx, 409 (a moved server), bad replies."""
        return self.status is None or self.status >= 500 or self.status == 409 or self.code == "bad_reply"
