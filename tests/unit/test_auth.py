"""Request signing (shared/auth.py): what passes, and each way a request is refused."""

from __future__ import annotations

import pytest

from shared.auth import NONCE, SIGNATURE, TIMESTAMP, Unauthorized, Verifier, load_secret, sign_headers

SECRET = b"correct horse battery staple"
OTHER = b"another swarm's secret value"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def verifier(clock=None, **kw) -> Verifier:
    return Verifier(SECRET, clock=clock or Clock(), **kw)


def signed(secret=SECRET, method="POST", path="/forward", body=b"payload", now=1_000_000.0, nonce=None):
    return sign_headers(secret, method, path, body, now=now, nonce=nonce)


def test_a_signed_request_passes_once_and_its_replay_is_refused():
    v = verifier()
    headers = signed()
    v.verify("POST", "/forward", headers, b"payload")
    with pytest.raises(Unauthorized, match="replayed"):
        v.verify("POST", "/forward", headers, b"payload")
    v.verify("POST", "/forward", signed(), b"payload")  # a new nonce: a new request


@pytest.mark.parametrize(
    "case, change",
    [
        ("unsigned", lambda h, req: ({}, req)),
        ("no signature", lambda h, req: ({k: v for k, v in h.items() if k != SIGNATURE}, req)),
        ("forged signature", lambda h, req: ({**h, SIGNATURE: "0" * 64}, req)),
        ("malformed signature", lambda h, req: ({**h, SIGNATURE: "xyz"}, req)),
        ("malformed nonce", lambda h, req: ({**h, NONCE: "a b"}, req)),
        ("timestamp not a number", lambda h, req: ({**h, TIMESTAMP: "soon"}, req)),
        ("timestamp changed after signing", lambda h, req: ({**h, TIMESTAMP: "1000001.000"}, req)),
        ("body altered", lambda h, req: (h, {**req, "body": b"payloaD"})),
        ("path altered", lambda h, req: (h, {**req, "path": "/backward"})),
        ("method altered", lambda h, req: (h, {**req, "method": "PUT"})),
        ("wrong secret", lambda h, req: (signed(secret=OTHER), req)),
    ],
)
def test_refused(case, change):
    headers, req = change(signed(), {"method": "POST", "path": "/forward", "body": b"payload"})
    with pytest.raises(Unauthorized):
        verifier().verify(req["method"], req["path"], headers, req["body"])


def test_expired_and_future_timestamps_are_refused_within_the_skew_they_pass():
    clock = Clock()
    v = verifier(clock, max_skew_s=30)
    v.verify("POST", "/forward", signed(now=clock.now - 29), b"payload")
    v.verify("POST", "/forward", signed(now=clock.now + 29), b"payload")
    for ts in (clock.now - 31, clock.now + 31):
        with pytest.raises(Unauthorized, match="from this server's clock"):
            v.verify("POST", "/forward", signed(now=ts), b"payload")


def test_nonces_are_forgotten_when_they_expire_and_a_full_memory_refuses_what_it_forgot():
    clock = Clock()
    v = verifier(clock, max_skew_s=30, max_nonces=3)
    old = signed(now=clock.now)
    v.verify("POST", "/forward", old, b"payload")
    clock.now += 31
    v.verify("POST", "/forward", signed(now=clock.now), b"payload")
    assert len(v._seen) == 1  # the first nonce expired with its timestamp
    with pytest.raises(Unauthorized, match="from this server's clock"):
        v.verify("POST", "/forward", old, b"payload")  # and its replay is refused as expired

    requests = [signed(now=clock.now + i / 10) for i in range(1, 5)]
    for h in requests:
        v.verify("POST", "/forward", h, b"payload")
    assert len(v._seen) == 3  # bounded
    for h in requests[:2]:  # forgotten nonces: refused by the horizon, not replayable
        with pytest.raises(Unauthorized, match="replayed"):
            v.verify("POST", "/forward", h, b"payload")


def test_load_secret(tmp_path):
    assert load_secret() is None
    assert load_secret("s" * 16) == b"s" * 16
    path = tmp_path / "secret"
    path.write_text("  a-secret-from-a-file-123\n")
    assert load_secret(secret_file=str(path)) == b"a-secret-from-a-file-123"
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
    with pytest.raises(ValueError, match="not both"):
        load_secret("s" * 16, str(path))
    with pytest.raises(ValueError, match="SWARM_SECRET_FILE"):
        load_secret(secret_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(secret_file=str(tmp_path / "empty"))
