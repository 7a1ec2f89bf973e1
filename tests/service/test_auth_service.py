"""Signed requests and TLS on real services (in this process, on loopback).

With a swarm secret, a stage server and the coordinator serve only signed requests:
unsigned, forged, expired, replayed and wrong-secret requests get 401 with a JSON error and
an ``auth.refused`` log line, and nothing they carry reaches the model or the registry;
``GET /health`` and ``GET /metrics`` (and the coordinator's dashboard) stay open. A member's
session (``swarm_session``) signs by itself. With a certificate, the services speak HTTPS and
a member trusts the swarm's own CA file.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time

import aiohttp
import pytest
from aiohttp import web

from services.coordinator.app import create_app as create_coordinator
from services.coordinator.routes import REGISTRY
from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from shared.auth import NONCE, SIGNATURE, TIMESTAMP, sign_headers
from shared.codec import encode_tensor, pack_message
from shared.config import StageServerSettings
from shared.http import server_ssl_context, swarm_session
from tests.conftest import coordinator_settings, stage_settings

SECRET = "a-test-secret-of-the-swarm-0123456789"
OTHER = "the-secret-of-another-swarm-98765"


@pytest.fixture
async def serve():
    """``await serve(app, ssl_context=None)`` -> base URL; every site is closed at the end."""
    runners: list[web.AppRunner] = []

    async def _serve(app: web.Application, ssl_context: ssl.SSLContext | None = None) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        return f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"

    yield _serve
    for runner in runners:
        await runner.cleanup()


def forward_body() -> bytes:
    import torch

    tokens = torch.randint(0, 256, (2, 16), dtype=torch.int64)
    return pack_message(
        {
            "v": 1,
            "run_id": "test",
            "stage": 0,
            "microbatch_id": "m1",
            "seed": 0,
            "inputs": encode_tensor(tokens, "fp32"),
            "codec": "fp32",
        }
    )


async def status_and_error(resp) -> tuple[int, str | None]:
    body = await resp.read()
    try:
        return resp.status, json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return resp.status, None


async def test_only_signed_requests_are_served(serve, http_session, capsys):
    app = create_app(stage_settings(0, secret=SECRET))
    stage = await serve(app)
    coordinator_app = create_coordinator(coordinator_settings(secret=SECRET))
    coordinator = await serve(coordinator_app)
    body = forward_body()
    weights_version = app[RUNTIME].version

    # open: probes, scrapers, the dashboard
    for url in (
        stage + "/health",
        stage + "/metrics",
        coordinator + "/health",
        coordinator + "/metrics",
        coordinator + "/",
        coordinator + "/dashboard.json",
    ):
        async with http_session.get(url) as resp:
            assert resp.status == 200, url

    # refused: unsigned, forged, expired, replayed, wrong secret (each with a JSON 401)
    headers = {"Content-Type": "application/msgpack"}
    good = sign_headers(SECRET.encode(), "POST", "/forward", body)
    cases = {
        "unsigned": {},
        "forged": {**good, SIGNATURE: "f" * 64},
        "expired": sign_headers(SECRET.encode(), "POST", "/forward", body, now=time.time() - 3600),
        "wrong secret": sign_headers(OTHER.encode(), "POST", "/forward", body),
        "body of another request": sign_headers(SECRET.encode(), "POST", "/forward", b"something else"),
    }
    for case, extra in cases.items():
        async with http_session.post(stage + "/forward", data=body, headers={**headers, **extra}) as resp:
            assert await status_and_error(resp) == (401, "unauthorized"), case
    async with http_session.post(stage + "/forward", data=body, headers={**headers, **good}) as resp:
        assert resp.status == 200  # signed: served
    async with http_session.post(stage + "/forward", data=body, headers={**headers, **good}) as resp:
        assert await status_and_error(resp) == (401, "unauthorized")  # the same request again: a replay
    registration = {
        "run_id": "test",
        "server_id": "s1",
        "stage": 0,
        "url": "http://127.0.0.1:9",
        "version": "t",
        "throughput": 1.0,
        "queue_length": 0,
    }
    async with http_session.post(coordinator + "/register", json=registration) as resp:
        assert await status_and_error(resp) == (401, "unauthorized")
    assert coordinator_app[REGISTRY].live() == [], "a refused request reached the registry"
    assert app[RUNTIME].stats.forwards == 1 and app[RUNTIME].version == weights_version
    assert capsys.readouterr().out.count("auth.refused") >= len(cases) + 2  # one log line per refusal

    # a member's session signs by itself
    settings = stage_settings(0, secret=SECRET)
    async with swarm_session(settings) as session:
        async with session.post(coordinator + "/register", json=registration) as resp:
            assert resp.status == 200
        async with session.get(stage + "/info") as resp:
            assert resp.status == 200
    assert [s.server_id for s in coordinator_app[REGISTRY].live()] == ["s1"]
    async with swarm_session(stage_settings(0, secret=OTHER)) as session:
        async with session.get(stage + "/info") as resp:
            assert resp.status == 401


def test_a_secret_too_short_or_unreadable_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="at least 16"):
        stage_settings(0, secret="short")
    with pytest.raises(ValueError, match="SWARM_SECRET_FILE"):
        stage_settings(0, secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="go together"):
        stage_settings(0, tls_cert_file=str(tmp_path / "cert.pem"))


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made by openssl (Debian's, in CI too)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make the test certificate"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


async def test_tls_serves_https_to_members_who_trust_the_swarm_certificate(serve, tmp_path):
    cert, key = self_signed(tmp_path)
    settings: StageServerSettings = stage_settings(
        0, secret=SECRET, tls_cert_file=cert, tls_key_file=key, tls_ca_file=cert
    )
    stage = await serve(create_app(settings), ssl_context=server_ssl_context(settings))
    assert stage.startswith("https://")
    async with swarm_session(settings) as session:
        async with session.get(stage + "/info") as resp:  # signed, over TLS, certificate checked
            assert resp.status == 200 and (await resp.json())["stage"] == 0
    async with aiohttp.ClientSession() as untrusting:  # the system's CAs do not know the swarm's certificate
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with untrusting.get(stage + "/health"):
                pass
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):  # plain HTTP to a TLS port
            async with plain.get(stage.replace("https://", "http://") + "/health"):
                pass


def test_nonce_and_timestamp_headers_are_named_as_documented():
    assert (TIMESTAMP, NONCE, SIGNATURE) == ("X-Swarm-Timestamp", "X-Swarm-Nonce", "X-Swarm-Signature")
