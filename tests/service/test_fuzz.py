"""Fuzzing every endpoint that takes a body: 10,000+ generated bodies (hypothesis) against
the stage server's /forward, /backward and averaging endpoints and the coordinator's
registry, in this process over loopback.

Bodies are built to get past the first checks and fail later: well-formed messages with
one field wrong (type, range, shape, dtype, non-finite values, oversize), tensors whose
bytes do not match their shape, random msgpack/JSON structures, raw bytes, wrong content
types. Every reply must be a clean answer (2xx, or 4xx/503 with a JSON error), never a 5xx
nor a crash; every rejected request must leave the stage's weights, version, statistics and
accumulated gradients, and the registry, exactly as they were.
"""

from __future__ import annotations

import asyncio
import json
import math

import msgpack
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.coordinator.app import create_app as create_coordinator
from services.coordinator.routes import REGISTRY
from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from services.stage_server.runtime import flat_parameters
from shared.codec import encode_tensor
from tests.conftest import coordinator_settings, stage_settings

STAGE, NUM_STAGES, SEQ = 1, 4, 8
EXAMPLES = {"forward": 2500, "backward": 2500, "averaging": 2600, "registry": 2600}  # 10,200 bodies in all
SEEN = {"statuses": {}}
# The last test reads the statuses the others' bodies got: with two pytest workers
# (pytest-xdist), every in-process test runs in collection order on one (tests/conftest.py).


# --------------------------------------------------------------------------- strategies
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=64),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def tensors(draw):
    """An encoded tensor, valid or broken in one way."""
    shape = draw(
        st.sampled_from([[2, SEQ, 64], [2, SEQ], [1, 1, 64], [2, SEQ, 63], [0, SEQ, 64], [2**31, 2**31], [-1, 4], []])
    )
    dtype = draw(
        st.sampled_from(
            ["float32", "float16", "bfloat16", "int64", "int32", "uint8", "float64", "complex64", "nonsense"]
        )
    )
    values = draw(st.sampled_from(["ok", "nan", "inf", "huge"]))
    codec = draw(st.sampled_from(["fp32", "fp16", "int8", "raw"]))
    n = max(0, math.prod(shape)) if all(isinstance(d, int) and 0 <= d < 4096 for d in shape) else 0
    base = (
        torch.randn(n) if values == "ok" else torch.full((n,), {"nan": math.nan, "inf": math.inf, "huge": 3e38}[values])
    )
    try:
        enc = encode_tensor(
            base.reshape([d for d in shape]) if n else torch.zeros(2, SEQ, 64), codec if codec != "raw" else "fp32"
        )
        enc = dict(enc)
    except Exception:  # noqa: BLE001 - an unencodable shape: send a hand-made header
        enc = {"codec": codec, "dtype": dtype, "shape": shape, "data": b"\x00" * 16}
    mutation = draw(st.sampled_from(["none", "dtype", "shape", "truncate", "extend", "codec", "drop", "junk"]))
    if mutation == "dtype":
        enc["dtype"] = dtype
    elif mutation == "shape":
        enc["shape"] = draw(st.one_of(st.just(shape), junk))
    elif mutation == "truncate":
        enc["data"] = bytes(enc["data"])[: max(0, len(bytes(enc["data"])) - draw(st.integers(1, 8)))]
    elif mutation == "extend":
        enc["data"] = bytes(enc["data"]) + b"\x01" * draw(st.integers(1, 8))
    elif mutation == "codec":
        enc["codec"] = draw(st.one_of(st.sampled_from(["int2", "", "raw", "fp64"]), junk))
    elif mutation == "drop":
        enc.pop(draw(st.sampled_from(sorted(enc))))
    elif mutation == "junk":
        enc[draw(st.sampled_from(sorted(enc)))] = draw(junk)
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in enc.items()}


def valid_stage_message(*, backward: bool) -> dict:
    h = torch.randn(2, SEQ, 64)
    msg = {
        "v": 1,
        "run_id": "test",
        "stage": STAGE,
        "microbatch_id": "mb-1",
        "seed": 1,
        "codec": "fp32",
        "inputs": _plain(encode_tensor(h, "fp32")),
    }
    if backward:
        msg["grad_outputs"] = _plain(encode_tensor(torch.randn(2, SEQ, 64), "fp32"))
    return msg


def _plain(enc: dict) -> dict:
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in enc.items()}


@st.composite
def stage_bodies(draw, backward: bool):
    """(content type, body bytes) for /forward or /backward."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "junk", "raw", "content-type"]))
    msg = valid_stage_message(backward=backward)
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 3))):
            key = draw(
                st.sampled_from(
                    [
                        "v",
                        "run_id",
                        "stage",
                        "microbatch_id",
                        "seed",
                        "codec",
                        "eval",
                        "inputs",
                        "targets",
                        "grad_outputs",
                        "extra",
                    ]
                )
            )
            value = (
                draw(tensors()) if key in ("inputs", "targets", "grad_outputs") and draw(st.booleans()) else draw(junk)
            )
            if draw(st.integers(0, 9)) == 0:
                msg.pop(key, None)
            else:
                msg[key] = value
        return "application/msgpack", msgpack.packb(msg, use_bin_type=True)
    if kind == "junk":
        return "application/msgpack", msgpack.packb(draw(junk), use_bin_type=True)
    if kind == "raw":
        return "application/msgpack", draw(st.binary(max_size=512))
    return draw(st.sampled_from(["application/json", "text/plain", ""])), msgpack.packb(msg, use_bin_type=True)


@st.composite
def averaging_bodies(draw):
    path = draw(st.sampled_from(["/average/start", "/average/part", "/average/result"]))
    base = {
        "/average/start": {
            "round_id": "r1",
            "stage": STAGE,
            "members": ["http://127.0.0.1:9", "http://127.0.0.1:10"],
            "index": 0,
            "codec": "fp32",
            "timeout_s": 0.05,
            "aggregator": "mean",
        },
        "/average/part": {
            "round_id": "r1",
            "from": 1,
            "part": 0,
            "weight": 3.0,
            "data": _plain(encode_tensor(torch.randn(10), "fp32")),
        },
        "/average/result": {"round_id": "r1", "part": 0},
    }[path]
    msg = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*sorted(msg), "extra"]))
        msg[key] = draw(tensors()) if key == "data" and draw(st.booleans()) else draw(junk)
    if draw(st.integers(0, 5)) == 0:
        return path, "application/msgpack", draw(st.binary(max_size=256))
    return path, "application/msgpack", msgpack.packb(msg, use_bin_type=True)


@st.composite
def registry_bodies(draw):
    path = draw(st.sampled_from(["/register", "/heartbeat", "/deregister", "/assign", "/progress", "/average"]))
    base = {
        "/register": {
            "run_id": "test",
            "server_id": "fuzz-1",
            "stage": 0,
            "url": "http://127.0.0.1:9",
            "version": "t",
            "throughput": 1.0,
            "queue_length": 0,
        },
        "/heartbeat": {"server_id": "fuzz-1", "throughput": 1.0, "queue_length": 0},
        "/deregister": {"server_id": "fuzz-1"},
        "/assign": {"run_id": "test"},
        "/progress": {
            "run_id": "test",
            "trainer_id": "t1",
            "records": [{"step": 1, "loss": 3.0, "tokens_per_s": 10.0}],
        },
        "/average": {},
    }[path]
    msg = dict(base)
    for _ in range(draw(st.integers(1, 3))):
        msg[draw(st.sampled_from([*sorted(msg), "extra"]))] = draw(junk)
    kind = draw(st.sampled_from(["json", "json", "json", "raw", "content-type", "nonfinite"]))
    if kind == "raw":
        return path, "application/json", draw(st.binary(max_size=256))
    body = json.dumps(_jsonable(msg), allow_nan=True).encode()
    if kind == "nonfinite":
        body = body.replace(b"1.0", b"NaN", 1) if b"1.0" in body else body + b"x"
    return path, ("application/json" if kind != "content-type" else "text/plain"), body


def _jsonable(x):
    if isinstance(x, bytes):
        return x.decode("latin-1")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    if isinstance(x, int) and abs(x) > 2**63:
        return float(x)
    return x


# --------------------------------------------------------------------------- harness
class Target:
    """An app served on loopback, driven from a private event loop (hypothesis calls are sync)."""

    def __init__(self, app):
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(app, host="127.0.0.1"), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())
        self.app = app

    def post(self, path: str, content_type: str, body: bytes) -> tuple[int, bytes, dict]:
        async def go():
            headers = {"Content-Type": content_type} if content_type else {}
            async with self.client.post(path, data=body, headers=headers, skip_auto_headers=["Content-Type"]) as resp:
                return resp.status, await resp.read(), dict(resp.headers)

        return self.loop.run_until_complete(go())

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self):
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def check_reply(status: int, body: bytes, headers: dict, where: str) -> None:
    SEEN["statuses"][status] = SEEN["statuses"].get(status, 0) + 1
    assert status < 500 or status == 503, f"{where}: {status} {body[:300]!r}"
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["code"], str) and isinstance(error["message"], str), f"{where}: {body[:300]!r}"
        if status == 503:
            assert "Retry-After" in headers, f"{where}: 503 without Retry-After"


@pytest.fixture(scope="module")
def stage():
    target = Target(create_app(stage_settings(STAGE, num_stages=NUM_STAGES, max_body_mb=1)))
    yield target
    target.close()


@pytest.fixture(scope="module")
def coordinator():
    settings = coordinator_settings(num_stages=NUM_STAGES, averaging_timeout_s=0.2, max_servers=8)
    target = Target(create_coordinator(settings))
    yield target
    target.close()


def stage_state(target: Target) -> tuple:
    rt = target.app[RUNTIME]
    return (
        rt.version,
        rt.stats.forwards,
        rt.stats.backwards,
        rt.stats.samples,
        rt.stats.optimizer_steps,
        rt.pending_samples,
    )


def gradient_versions(target: Target) -> list[tuple[int, int]]:
    """Identity and in-place version counter of every gradient accumulator: any write to one
    (``add_``, ``zero_``, a copy into it) bumps its version. As exact as comparing copies,
    without copying the stage's gradients for each of thousands of bodies."""
    return [(id(g), g._version) for g in target.app[RUNTIME].accumulators()]


def fuzz(examples: int):
    """Deterministic (derandomize) so CI runs the same bodies every time; no example database."""
    return settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )


@fuzz(EXAMPLES["forward"])
@given(case=stage_bodies(backward=False))
def test_fuzz_forward(stage, case):
    content_type, body = case
    before = stage_state(stage)
    status, reply, headers = stage.post("/forward", content_type, body)
    check_reply(status, reply, headers, "/forward")
    if status != 200:
        assert stage_state(stage) == before, "a rejected /forward changed the stage"


@fuzz(EXAMPLES["backward"])
@given(case=stage_bodies(backward=True))
def test_fuzz_backward(stage, case):
    content_type, body = case
    before = stage_state(stage)
    grads = gradient_versions(stage)
    status, reply, headers = stage.post("/backward", content_type, body)
    check_reply(status, reply, headers, "/backward")
    if status != 200:
        assert stage_state(stage) == before, "a rejected /backward changed the stage"
        assert gradient_versions(stage) == grads, "a rejected /backward accumulated gradients"


@fuzz(EXAMPLES["averaging"])
@given(case=averaging_bodies())
def test_fuzz_averaging(stage, case):
    path, content_type, body = case
    before = stage_state(stage)
    status, reply, headers = stage.post(path, content_type, body)
    check_reply(status, reply, headers, path)
    if status != 200:
        assert stage_state(stage) == before, f"a rejected {path} changed the stage"


@fuzz(EXAMPLES["registry"])
@given(case=registry_bodies())
def test_fuzz_registry(coordinator, case):
    path, content_type, body = case
    registry = coordinator.app[REGISTRY]
    before = registry.live()
    status, reply, headers = coordinator.post(path, content_type, body)
    check_reply(status, reply, headers, path)
    if status >= 400:
        assert registry.live() == before, f"a rejected {path} changed the registry"
    else:
        registry.deregister("fuzz-1") if registry.live() else None  # keep each example independent


def test_fuzz_left_the_weights_as_they_were_and_sent_every_kind_of_body(stage):
    """Runs after the fuzz tests (file order): no accepted body could step the optimizer
    (global_batch is 10**6), so the weights are the initial ones; and the fuzzers
    reached both refusals and real work."""
    reference = create_app(stage_settings(STAGE, num_stages=NUM_STAGES, max_body_mb=1))[RUNTIME]
    now = stage.run(asyncio.to_thread(flat_parameters, stage.app[RUNTIME].params))
    assert torch.equal(now, flat_parameters(reference.params))
    assert stage.app[RUNTIME].stats.optimizer_steps == 0
    statuses = SEEN["statuses"]
    assert sum(statuses.values()) >= 10_000, statuses
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 1000, statuses
    print(f"\nfuzz: {sum(statuses.values())} bodies, replies by status {dict(sorted(statuses.items()))}")
