"""Service tests of one stage server: every bad request is refused with the right status
and a JSON error, leaves the weights and the gradient accumulator alone, and the server
keeps answering good requests afterwards.

Each test runs the real aiohttp app (``create_app``) through ``aiohttp_client`` on
loopback; the model is ``tiny`` (d_model 128, block_size 128, vocab 256, 4 layers) cut
into 4 stages of one block each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import pytest
import torch

from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from shared import WIRE_VERSION
from shared.codec import decode_tensor, encode_tensor, pack_message, unpack_message
from shared.config import StageServerSettings

MSGPACK = "application/msgpack"
RUN_ID = "test-run"
NUM_STAGES, LAST = 4, 3
B, T, D_MODEL, BLOCK_SIZE, VOCAB = 2, 8, 128, 128, 256


def settings(stage: int, **overrides) -> StageServerSettings:
    """Every field that matters given explicitly, so SWARM_* variables cannot leak in."""
    fields = dict(
        run_id=RUN_ID,
        model="tiny",
        num_stages=NUM_STAGES,
        stage=stage,
        seed=0,
        device="cpu",
        wire_codec="fp32",
        int8_block=4096,
        lr=1e-3,
        warmup_steps=0,
        global_batch=10**6,  # no optimizer step unless a test asks for one
        max_body_mb=16.0,
        max_queue=64,
        backward_cache=16,
        drain_timeout_s=5.0,
        mdns=False,
        coordinator="",
    )
    return StageServerSettings(**{**fields, **overrides})


@pytest.fixture
def start(aiohttp_client):
    async def _start(stage: int, **overrides):
        return await aiohttp_client(create_app(settings(stage, **overrides)))

    return _start


# --------------------------------------------------------------------------- payload builders

_gen = torch.Generator().manual_seed(1234)


def hidden(b: int = B, t: int = T, d: int = D_MODEL) -> torch.Tensor:
    return torch.randn(b, t, d, generator=_gen)


def tokens(b: int = B, t: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=_gen)


def enc(t: torch.Tensor) -> dict:
    return encode_tensor(t, "fp32")


def good_inputs(stage: int) -> torch.Tensor:
    return tokens() if stage == 0 else hidden()


def message(stage: int, /, *, backward: bool = False, **fields) -> dict:
    """A well-formed request for ``stage``; ``fields`` override or (value ``DROP``) remove keys."""
    msg = {"run_id": RUN_ID, "stage": stage, "microbatch_id": "mb-1", "seed": 7, "inputs": enc(good_inputs(stage))}
    if stage == LAST:
        msg["targets"] = enc(tokens())
    elif backward:
        msg["grad_outputs"] = enc(hidden())
    msg.update(fields)
    return {k: v for k, v in msg.items() if v is not DROP}


DROP = object()


def body(stage: int, /, *, backward: bool = False, **fields) -> bytes:
    return pack_message(message(stage, backward=backward, **fields))


def with_value(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t[0, T // 2, 3] = value
    return t


def token_with(value: int) -> torch.Tensor:
    t = tokens()
    t[1, 3] = value
    return t


async def post(client, path: str, data: bytes, content_type: str | None = MSGPACK):
    if content_type is None:
        resp = await client.post(path, data=data, skip_auto_headers=["Content-Type"])
        assert "Content-Type" not in resp.request_info.headers
        return resp
    return await client.post(path, data=data, headers={"Content-Type": content_type})


# --------------------------------------------------------------------------- assertions


def snapshot(app) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in app[RUNTIME].model.state_dict().items()}


def assert_untouched(app, before: dict[str, torch.Tensor]) -> None:
    runtime = app[RUNTIME]
    after = runtime.model.state_dict()
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"weights changed by a refused request: {changed}"
    assert runtime.pending_samples == 0
    assert runtime.version == 0 and runtime.stats.optimizer_steps == 0
    assert all(float(g.abs().sum()) == 0.0 for g in runtime.accumulated_gradients().values())


async def assert_json_error(resp, status: int, code: str, match: str | None = None) -> str:
    text = await resp.text()
    assert resp.status == status, text
    assert resp.content_type == "application/json", text
    payload = await resp.json()
    assert set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"code", "message"}, payload
    assert payload["error"]["code"] == code, payload
    message_ = payload["error"]["message"]
    assert isinstance(message_, str) and message_
    if match is not None:
        assert match in message_, message_
    return message_


async def forward_ok(client, stage: int, *, b: int = B, t: int = T) -> dict:
    """A good forward must still be answered 200 with the right output."""
    inputs = tokens(b, t) if stage == 0 else hidden(b, t)
    fields = {"inputs": enc(inputs), "microbatch_id": "good"}
    if stage == LAST:
        fields["targets"] = enc(tokens(b, t))
    resp = await post(client, "/forward", body(stage, **fields))
    assert resp.status == 200, await resp.text()
    assert resp.content_type == MSGPACK
    reply = unpack_message(await resp.read())
    assert reply["stage"] == stage and reply["microbatch_id"] == "good"
    if stage == LAST:
        assert "outputs" not in reply
        assert isinstance(reply["loss"], float) and math.isfinite(reply["loss"])
        assert abs(reply["loss"] - math.log(VOCAB)) < 1.0  # freshly initialised: about ln(256)
    else:
        out = decode_tensor(reply["outputs"], name="outputs")
        assert out.dtype == torch.float32 and list(out.shape) == [b, t, D_MODEL]
        assert bool(torch.isfinite(out).all())
    return reply


# --------------------------------------------------------------------------- bad requests


@dataclass(frozen=True)
class Bad:
    stage: int
    path: str
    data: bytes
    status: int
    code: str
    match: str
    content_type: str | None = MSGPACK


def _bad(
    id_: str,
    stage: int,
    data: bytes,
    status: int,
    code: str,
    match: str,
    *,
    path: str = "/forward",
    content_type=MSGPACK,
):
    return pytest.param(Bad(stage, path, data, status, code, match, content_type), id=id_)


BAD_REQUESTS = [
    # 415: the content type
    _bad(
        "415-json",
        1,
        body(1),
        415,
        "unsupported_media_type",
        "expected Content-Type application/msgpack",
        content_type="application/json",
    ),
    _bad("415-text", 1, body(1), 415, "unsupported_media_type", "'text/plain'", content_type="text/plain"),
    _bad(
        "415-x-msgpack",
        1,
        body(1),
        415,
        "unsupported_media_type",
        "'application/x-msgpack'",
        content_type="application/x-msgpack",
    ),
    _bad(
        "415-missing",
        1,
        body(1),
        415,
        "unsupported_media_type",
        "expected Content-Type application/msgpack",
        content_type=None,
    ),
    _bad(
        "415-backward",
        1,
        body(1, backward=True),
        415,
        "unsupported_media_type",
        "got 'application/json'",
        path="/backward",
        content_type="application/json",
    ),
    # 400: the body is not a message
    _bad("400-not-msgpack", 1, b"\xc1\xc1\xc1", 400, "bad_payload", "not valid msgpack"),
    _bad("400-json-body", 1, b'{"v": 1, "stage": 1}', 400, "bad_payload", "not valid msgpack"),
    _bad("400-empty-body", 1, b"", 400, "bad_payload", "not valid msgpack"),
    _bad(
        "400-not-a-map",
        1,
        msgpack.packb([WIRE_VERSION, 1, "mb"]),
        400,
        "bad_payload",
        "must be a msgpack map, got list",
    ),
    _bad(
        "400-wrong-version",
        1,
        msgpack.packb({**message(1), "v": WIRE_VERSION + 1}, use_bin_type=True),
        400,
        "bad_payload",
        f"wire version {WIRE_VERSION + 1} not supported",
    ),
    _bad(
        "400-missing-version",
        1,
        msgpack.packb(message(1), use_bin_type=True),
        400,
        "bad_payload",
        "wire version None not supported",
    ),
    # 400: the message fields
    _bad("400-stage-missing", 1, body(1, stage=DROP), 400, "bad_payload", "'stage' must be an int"),
    _bad("400-stage-str", 1, body(1, stage="1"), 400, "bad_payload", "'stage' must be an int"),
    _bad("400-stage-bool", 1, body(1, stage=True), 400, "bad_payload", "'stage' must be an int"),
    _bad("400-missing-inputs", 1, body(1, inputs=DROP), 400, "bad_payload", "'inputs' is missing"),
    _bad("400-nil-inputs", 1, body(1, inputs=None), 400, "bad_payload", "'inputs' is missing"),
    _bad(
        "400-missing-inputs-backward",
        1,
        body(1, backward=True, inputs=DROP),
        400,
        "bad_payload",
        "'inputs' is missing",
        path="/backward",
    ),
    _bad("400-inputs-not-a-tensor", 1, body(1, inputs="hello"), 400, "bad_payload", "inputs: expected a tensor map"),
    _bad(
        "400-inputs-malformed",
        1,
        body(1, inputs={**enc(hidden()), "shape": [B, T, D_MODEL + 1]}),
        400,
        "bad_payload",
        "inputs: 8192 bytes for 2064 values",
    ),
    _bad("400-mb-id-missing", 1, body(1, microbatch_id=DROP), 400, "bad_payload", "'microbatch_id' must be a string"),
    _bad("400-mb-id-int", 1, body(1, microbatch_id=17), 400, "bad_payload", "'microbatch_id' must be a string"),
    _bad("400-mb-id-empty", 1, body(1, microbatch_id=""), 400, "bad_payload", "'microbatch_id' must be a string"),
    _bad(
        "400-mb-id-too-long",
        1,
        body(1, microbatch_id="x" * 129),
        400,
        "bad_payload",
        "'microbatch_id' must be a string of 1..128",
    ),
    _bad("400-mb-id-bytes", 1, body(1, microbatch_id=b"mb"), 400, "bad_payload", "'microbatch_id' must be a string"),
    _bad("400-seed-negative", 1, body(1, seed=-1), 400, "bad_payload", "'seed' must be an int in [0, 2**63)"),
    _bad("400-seed-too-big", 1, body(1, seed=2**63), 400, "bad_payload", "'seed' must be an int"),
    _bad("400-seed-str", 1, body(1, seed="7"), 400, "bad_payload", "'seed' must be an int"),
    _bad("400-seed-float", 1, body(1, seed=7.0), 400, "bad_payload", "'seed' must be an int"),
    _bad("400-seed-bool", 1, body(1, seed=True), 400, "bad_payload", "'seed' must be an int"),
    _bad(
        "400-seed-backward",
        1,
        body(1, backward=True, seed=-5),
        400,
        "bad_payload",
        "'seed' must be an int",
        path="/backward",
    ),
    _bad("400-reply-codec-unknown", 1, body(1, codec="fp8"), 400, "bad_payload", "'codec' must be one of"),
    _bad("400-reply-codec-raw", 1, body(1, codec="raw"), 400, "bad_payload", "got 'raw'"),
    _bad("400-reply-codec-nil", 1, body(1, codec=None), 400, "bad_payload", "got None"),
    _bad("400-eval-not-bool", 1, body(1, eval=1), 400, "bad_payload", "'eval' must be a bool"),
    # 400: hidden states that do not fit stage 1
    _bad(
        "400-hidden-wrong-d-model",
        1,
        body(1, inputs=enc(hidden(d=64))),
        400,
        "bad_payload",
        "hidden states must be (batch, seq, 128), got [2, 8, 64]",
    ),
    _bad(
        "400-hidden-2d",
        1,
        body(1, inputs=enc(torch.randn(B, D_MODEL))),
        400,
        "bad_payload",
        "hidden states must be (batch, seq, 128), got [2, 128]",
    ),
    _bad(
        "400-hidden-4d",
        1,
        body(1, inputs=enc(torch.randn(1, B, T, D_MODEL))),
        400,
        "bad_payload",
        "hidden states must be (batch, seq, 128)",
    ),
    _bad(
        "400-hidden-seq-too-long",
        1,
        body(1, inputs=enc(hidden(t=BLOCK_SIZE + 1))),
        400,
        "bad_payload",
        "1 <= seq <= 128, got (2, 129)",
    ),
    _bad("400-hidden-empty-batch", 1, body(1, inputs=enc(hidden(b=0))), 400, "bad_payload", "need batch >= 1"),
    _bad(
        "400-hidden-empty-seq", 1, body(1, inputs=enc(hidden(t=0))), 400, "bad_payload", "need batch >= 1 and 1 <= seq"
    ),
    _bad(
        "400-int-to-stage-1",
        1,
        body(1, inputs=enc(torch.randint(0, VOCAB, (B, T, D_MODEL)))),
        400,
        "bad_payload",
        "stage 1 takes float hidden states, got torch.int64",
    ),
    _bad(
        "400-tokens-to-stage-1",
        1,
        body(1, inputs=enc(tokens())),
        400,
        "bad_payload",
        "stage 1 takes float hidden states",
    ),
    _bad(
        "400-nan-hidden",
        1,
        body(1, inputs=enc(with_value(hidden(), math.nan))),
        400,
        "bad_payload",
        "hidden states contain non-finite values",
    ),
    _bad(
        "400-inf-hidden",
        1,
        body(1, inputs=enc(with_value(hidden(), math.inf))),
        400,
        "bad_payload",
        "hidden states contain non-finite values",
    ),
    _bad(
        "400-neg-inf-hidden", 1, body(1, inputs=enc(with_value(hidden(), -math.inf))), 400, "bad_payload", "non-finite"
    ),
    _bad(
        "400-nan-hidden-backward",
        1,
        body(1, backward=True, inputs=enc(with_value(hidden(), math.nan))),
        400,
        "bad_payload",
        "non-finite",
        path="/backward",
    ),
    _bad(
        "400-fp16-overflow-is-inf",
        1,
        body(1, inputs=encode_tensor(with_value(hidden(), 1e6), "fp16")),
        400,
        "bad_payload",
        "non-finite",
    ),
    # 400: token ids that do not fit stage 0
    _bad(
        "400-float-to-stage-0",
        0,
        body(0, inputs=enc(hidden())),
        400,
        "bad_payload",
        "stage 0 takes integer token ids, got torch.float32",
    ),
    _bad(
        "400-float-2d-to-stage-0",
        0,
        body(0, inputs=enc(tokens().float())),
        400,
        "bad_payload",
        "stage 0 takes integer token ids",
    ),
    _bad(
        "400-bool-to-stage-0",
        0,
        body(0, inputs=enc(tokens() > 100)),
        400,
        "bad_payload",
        "stage 0 takes integer token ids, got torch.bool",
    ),
    _bad(
        "400-tokens-3d",
        0,
        body(0, inputs=enc(torch.randint(0, VOCAB, (B, T, 1)))),
        400,
        "bad_payload",
        "token ids must be (batch, seq), got shape [2, 8, 1]",
    ),
    _bad(
        "400-token-too-big",
        0,
        body(0, inputs=enc(token_with(VOCAB))),
        400,
        "bad_payload",
        "token ids must lie in [0, 256)",
    ),
    _bad(
        "400-token-negative",
        0,
        body(0, inputs=enc(token_with(-1))),
        400,
        "bad_payload",
        "token ids must lie in [0, 256)",
    ),
    _bad(
        "400-token-huge",
        0,
        body(0, inputs=enc(torch.full((B, T), 2**40))),
        400,
        "bad_payload",
        "token ids must lie in [0, 256)",
    ),
    _bad(
        "400-tokens-seq-too-long",
        0,
        body(0, inputs=enc(tokens(t=BLOCK_SIZE + 1))),
        400,
        "bad_payload",
        "1 <= seq <= 128",
    ),
    # 400: backward of a middle stage
    _bad(
        "400-backward-no-grad-outputs",
        1,
        body(1, backward=True, grad_outputs=DROP),
        400,
        "bad_payload",
        "backward of stage 1 needs grad_outputs",
        path="/backward",
    ),
    _bad(
        "400-backward-stage-0-no-grad-outputs",
        0,
        body(0, backward=True, grad_outputs=DROP),
        400,
        "bad_payload",
        "backward of stage 0 needs grad_outputs",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-wrong-shape",
        1,
        body(1, backward=True, grad_outputs=enc(hidden(t=T - 1))),
        400,
        "bad_payload",
        "grad_outputs must have shape [2, 8, 128], got [2, 7, 128]",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-wrong-d",
        1,
        body(1, backward=True, grad_outputs=enc(hidden(d=D_MODEL * 2))),
        400,
        "bad_payload",
        "grad_outputs must have shape",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-nan",
        1,
        body(1, backward=True, grad_outputs=enc(with_value(hidden(), math.nan))),
        400,
        "bad_payload",
        "grad_outputs contain non-finite values",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-inf",
        1,
        body(1, backward=True, grad_outputs=enc(with_value(hidden(), -math.inf))),
        400,
        "bad_payload",
        "grad_outputs contain non-finite values",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-int",
        1,
        body(1, backward=True, grad_outputs=enc(torch.zeros(B, T, D_MODEL, dtype=torch.int64))),
        400,
        "bad_payload",
        "grad_outputs must be floats",
        path="/backward",
    ),
    _bad(
        "400-grad-outputs-malformed",
        1,
        body(1, backward=True, grad_outputs={**enc(hidden()), "codec": "fp64"}),
        400,
        "bad_payload",
        "grad_outputs: unknown codec 'fp64'",
        path="/backward",
    ),
    # 400: the last stage's targets
    _bad("400-last-no-targets", LAST, body(LAST, targets=DROP), 400, "bad_payload", "the last stage needs targets"),
    _bad(
        "400-last-no-targets-backward",
        LAST,
        body(LAST, backward=True, targets=DROP),
        400,
        "bad_payload",
        "the last stage needs targets",
        path="/backward",
    ),
    _bad(
        "400-targets-wrong-shape",
        LAST,
        body(LAST, targets=enc(tokens(t=T - 1))),
        400,
        "bad_payload",
        "targets must have shape [2, 8], got [2, 7]",
    ),
    _bad(
        "400-targets-3d",
        LAST,
        body(LAST, targets=enc(tokens().unsqueeze(-1))),
        400,
        "bad_payload",
        "targets must have shape [2, 8], got [2, 8, 1]",
    ),
    _bad(
        "400-targets-float",
        LAST,
        body(LAST, targets=enc(tokens().float())),
        400,
        "bad_payload",
        "targets must be integers, got torch.float32",
    ),
    _bad(
        "400-targets-too-big",
        LAST,
        body(LAST, targets=enc(torch.full((B, T), VOCAB))),
        400,
        "bad_payload",
        "targets must lie in [-1, 256)",
    ),
    _bad(
        "400-targets-below-minus-one",
        LAST,
        body(LAST, targets=enc(torch.full((B, T), -2))),
        400,
        "bad_payload",
        "targets must lie in [-1, 256)",
    ),
    _bad(
        "400-targets-out-of-range-backward",
        LAST,
        body(LAST, backward=True, targets=enc(torch.full((B, T), 1000))),
        400,
        "bad_payload",
        "targets must lie in",
        path="/backward",
    ),
    _bad(
        "400-last-int-inputs",
        LAST,
        body(LAST, inputs=enc(tokens())),
        400,
        "bad_payload",
        "stage 3 takes float hidden states",
    ),
    # 409: not for this server
    _bad("409-other-stage", 1, body(2), 409, "wrong_stage", "this server holds stage 1, not 2"),
    _bad(
        "409-other-stage-backward",
        1,
        body(0, backward=True),
        409,
        "wrong_stage",
        "this server holds stage 1, not 0",
        path="/backward",
    ),
    _bad("409-other-stage-last", LAST, body(1), 409, "wrong_stage", "this server holds stage 3, not 1"),
    _bad(
        "409-other-run",
        1,
        body(1, run_id="another-run"),
        409,
        "wrong_stage",
        f"belongs to run {RUN_ID!r}, not 'another-run'",
    ),
    _bad(
        "409-other-run-backward", 1, body(1, backward=True, run_id="x"), 409, "wrong_stage", "not 'x'", path="/backward"
    ),
]


@pytest.mark.parametrize("bad", BAD_REQUESTS)
async def test_bad_request_is_refused_and_changes_nothing(start, bad: Bad):
    client = await start(bad.stage)
    before = snapshot(client.app)

    resp = await post(client, bad.path, bad.data, bad.content_type)
    await assert_json_error(resp, bad.status, bad.code, bad.match)

    assert_untouched(client.app, before)
    await forward_ok(client, bad.stage)
    assert_untouched(client.app, before)  # a forward never touches weights or gradients


async def test_many_bad_requests_in_a_row_leave_one_server_working(start):
    """The same server, hit by one bad request after another, still computes the right thing."""
    client = await start(1)
    before = snapshot(client.app)
    x, g = hidden(), hidden()
    bads = [b for b in BAD_REQUESTS if b.values[0].stage == 1]
    for param in bads:
        bad = param.values[0]
        resp = await post(client, bad.path, bad.data, bad.content_type)
        assert resp.status == bad.status, (param.id, await resp.text())
    assert_untouched(client.app, before)
    resp = await post(client, "/backward", body(1, backward=True, inputs=enc(x), grad_outputs=enc(g)))
    assert resp.status == 200, await resp.text()
    grad = decode_tensor(unpack_message(await resp.read())["grad_inputs"])
    # The same gradient as a server that never saw a bad request.
    fresh = await start(1)
    resp = await post(fresh, "/backward", body(1, backward=True, inputs=enc(x), grad_outputs=enc(g)))
    assert torch.equal(grad, decode_tensor(unpack_message(await resp.read())["grad_inputs"]))


# --------------------------------------------------------------------------- 413


async def test_body_over_max_body_mb_is_413(start):
    client = await start(1, max_body_mb=0.5)
    before = snapshot(client.app)
    big = body(1, inputs=enc(hidden(b=2, t=BLOCK_SIZE, d=D_MODEL * 8)))  # 1 MiB of float32
    assert len(big) > 2**20
    resp = await post(client, "/forward", big)
    await assert_json_error(resp, 413, "payload_too_large", "exceeds the limit of 524288")
    assert_untouched(client.app, before)
    await forward_ok(client, 1)


async def test_chunked_body_over_max_body_mb_is_413(start):
    """Without Content-Length the limit is enforced while reading."""
    client = await start(1, max_body_mb=0.5)
    before = snapshot(client.app)
    big = body(1, inputs=enc(hidden(b=2, t=BLOCK_SIZE, d=D_MODEL * 8)))

    async def chunks():
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    resp = await client.post("/forward", data=chunks(), headers={"Content-Type": MSGPACK})
    assert "Content-Length" not in resp.request_info.headers
    await assert_json_error(resp, 413, "payload_too_large", "exceeds the limit of 524288")
    assert_untouched(client.app, before)
    await forward_ok(client, 1)


async def test_body_just_under_max_body_mb_is_accepted(start):
    client = await start(1, max_body_mb=0.5)
    data = body(1, inputs=enc(hidden(b=1, t=BLOCK_SIZE, d=D_MODEL)), microbatch_id="near-limit")
    assert 2**16 < len(data) < 0.5 * 2**20
    resp = await post(client, "/forward", data)
    assert resp.status == 200, await resp.text()


# --------------------------------------------------------------------------- 404 / 405


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("GET", "/forward", 405, "method_not_allowed"),
        ("GET", "/backward", 405, "method_not_allowed"),
        ("PUT", "/forward", 405, "method_not_allowed"),
        ("POST", "/health", 405, "method_not_allowed"),
        ("GET", "/nope", 404, "not_found"),
        ("POST", "/nope", 404, "not_found"),
        ("GET", "/", 404, "not_found"),
    ],
)
async def test_unknown_routes_and_methods_are_json_errors(start, method, path, status, code):
    client = await start(1)
    before = snapshot(client.app)
    resp = await client.request(
        method, path, data=body(1) if method != "GET" else None, headers={"Content-Type": MSGPACK}
    )
    await assert_json_error(resp, status, code)
    assert_untouched(client.app, before)
    await forward_ok(client, 1)


# --------------------------------------------------------------------------- good requests


@pytest.mark.parametrize(
    "reply_codec, tol", [(None, 0.0), ("fp32", 0.0), ("fp16", 1e-3), ("bf16", 1e-2), ("int8", 0.02)]
)
async def test_forward_at_a_middle_stage(start, reply_codec, tol):
    client = await start(1)
    runtime = client.app[RUNTIME]
    x = hidden(3, 16)
    fields = {"inputs": enc(x), "microbatch_id": "fwd"} | ({"codec": reply_codec} if reply_codec else {})
    resp = await post(client, "/forward", body(1, **fields))
    assert resp.status == 200, await resp.text()
    reply = unpack_message(await resp.read())
    assert (
        set(reply) == {"v", "stage", "microbatch_id", "step", "step_wait_s", "outputs"}
        and reply["step"] == runtime.step == 0
    )
    assert reply["outputs"]["codec"] == (reply_codec or "fp32")
    out = decode_tensor(reply["outputs"])
    assert out.dtype == torch.float32 and list(out.shape) == [3, 16, D_MODEL]
    with torch.no_grad():
        expected = runtime.model(x)
    err = float((out - expected).norm() / expected.norm())
    assert err <= tol + 1e-6, err
    assert runtime.pending_samples == 0


async def test_forward_at_the_first_stage(start):
    client = await start(0)
    reply = await forward_ok(client, 0, b=4, t=BLOCK_SIZE)
    assert decode_tensor(reply["outputs"]).shape == (4, BLOCK_SIZE, D_MODEL)


async def test_forward_at_the_last_stage_returns_the_loss(start):
    client = await start(LAST)
    await forward_ok(client, LAST)
    assert client.app[RUNTIME].pending_samples == 0


async def test_backward_at_a_middle_stage_accumulates(start):
    client = await start(1)
    runtime = client.app[RUNTIME]
    before = snapshot(client.app)
    x = hidden(3, 5)
    resp = await post(client, "/backward", body(1, backward=True, inputs=enc(x), grad_outputs=enc(hidden(3, 5))))
    assert resp.status == 200, await resp.text()
    reply = unpack_message(await resp.read())
    assert "loss" not in reply
    grad = decode_tensor(reply["grad_inputs"])
    assert grad.shape == x.shape and grad.dtype == torch.float32
    assert bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    assert runtime.pending_samples == 3
    assert any(float(g.abs().sum()) > 0 for g in runtime.accumulated_gradients().values())
    # No optimizer step yet (global_batch is huge): the weights are as they were.
    assert all(torch.equal(before[k], v) for k, v in runtime.model.state_dict().items())

    resp = await post(client, "/backward", body(1, backward=True, microbatch_id="mb-2"))
    assert resp.status == 200
    assert runtime.pending_samples == 3 + B


async def test_backward_at_the_last_stage_returns_loss_and_grad(start):
    client = await start(LAST)
    resp = await post(client, "/backward", body(LAST, backward=True))
    assert resp.status == 200, await resp.text()
    reply = unpack_message(await resp.read())
    assert math.isfinite(reply["loss"])
    assert decode_tensor(reply["grad_inputs"]).shape == (B, T, D_MODEL)
    assert client.app[RUNTIME].pending_samples == B


async def test_backward_at_the_first_stage_has_no_grad_inputs(start):
    client = await start(0)
    resp = await post(client, "/backward", body(0, backward=True))
    assert resp.status == 200, await resp.text()
    reply = unpack_message(await resp.read())
    assert "grad_inputs" not in reply and "loss" not in reply
    assert client.app[RUNTIME].pending_samples == B


async def test_optimizer_step_changes_weights_once_enough_samples(start):
    """The counterpart of ``assert_untouched``: an accepted backward does step the weights."""
    client = await start(1, global_batch=B)
    runtime = client.app[RUNTIME]
    before = snapshot(client.app)
    resp = await post(client, "/backward", body(1, backward=True))
    assert resp.status == 200, await resp.text()
    assert runtime.pending_samples == 0 and runtime.version == 1 and runtime.stats.optimizer_steps == 1
    assert any(not torch.equal(before[k], v) for k, v in runtime.model.state_dict().items())


async def test_health(start):
    client = await start(2)
    resp = await client.get("/health")
    assert resp.status == 200
    payload = await resp.json()
    assert payload["status"] == "ok"
    assert payload["stage"] == 2
    assert payload["queue_depth"] == 0
    assert payload["weights_version"] == 0


async def test_info(start):
    client = await start(1, wire_codec="bf16", global_batch=96)
    resp = await client.get("/info")
    assert resp.status == 200
    info = await resp.json()
    assert info["stage"] == 1
    assert info["num_stages"] == NUM_STAGES
    assert info["model"] == "tiny"
    assert info["wire_codec"] == "bf16"
    assert info["global_batch"] == 96
    assert info["run_id"] == RUN_ID
    assert info["wire_version"] == WIRE_VERSION
    assert info["layers"] == [1, 2]
    assert info["model_config"]["d_model"] == D_MODEL and info["model_config"]["block_size"] == BLOCK_SIZE
    assert info["parameters"] == sum(p.numel() for p in client.app[RUNTIME].model.parameters())


async def test_server_wire_codec_is_the_default_reply_codec(start):
    client = await start(1, wire_codec="fp16")
    resp = await post(client, "/forward", body(1))
    assert resp.status == 200
    assert unpack_message(await resp.read())["outputs"]["codec"] == "fp16"


# --------------------------------------------------------------------------- inputs that once crashed the server


@pytest.mark.parametrize("dtype, codec", [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
async def test_half_precision_hidden_states_are_not_a_500(start, dtype, codec):
    client = await start(1)
    resp = await post(client, "/forward", body(1, inputs=encode_tensor(hidden().to(dtype), codec)))
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
async def test_small_int_token_ids_are_not_a_500(start, dtype):
    client = await start(0)
    resp = await post(client, "/forward", body(0, inputs=enc(tokens().to(dtype))))
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
async def test_int32_targets_are_not_a_500(start, dtype):
    client = await start(LAST)
    resp = await post(client, "/forward", body(LAST, targets=enc(tokens().to(dtype))))
    assert resp.status == 200, await resp.text()


async def test_unhashable_dtype_is_400(start):
    client = await start(1)
    resp = await post(client, "/forward", body(1, inputs={**enc(hidden()), "dtype": ["float32"]}))
    await assert_json_error(resp, 400, "bad_payload")


async def test_float_int8_block_is_400(start):
    client = await start(1)
    resp = await post(client, "/forward", body(1, inputs={**encode_tensor(hidden(), "int8"), "block": 4096.0}))
    await assert_json_error(resp, 400, "bad_payload")


async def test_last_stage_backward_uses_its_own_targets(start):
    client = await start(LAST)
    x, ta, tb = hidden(), tokens(), tokens()
    common = {"inputs": enc(x), "microbatch_id": "same", "seed": 3}
    resp = await post(client, "/forward", body(LAST, targets=enc(ta), **common))
    loss_a = unpack_message(await resp.read())["loss"]
    resp = await post(client, "/backward", body(LAST, backward=True, targets=enc(tb), **common))
    loss_b_cached = unpack_message(await resp.read())["loss"]
    # Reference: the same backward on a server with no cached forward.
    fresh = await start(LAST)
    resp = await post(fresh, "/backward", body(LAST, backward=True, targets=enc(tb), **common))
    loss_b = unpack_message(await resp.read())["loss"]
    assert loss_a != loss_b
    assert loss_b_cached == loss_b
