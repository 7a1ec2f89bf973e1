"""The reference test: a model split over stage servers over HTTP computes what the whole
model computes in one process (exactly with the fp32 wire, within bounds with int8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.stage_server.routes import RUNTIME
from services.trainer.data import ByteBatcher, load_corpus
from services.trainer.pipeline import PipelineClient
from shared.codec import decode_tensor, encode_tensor
from shared.http import post_message
from shared.model import PRESETS, build_gpt
from tests.conftest import balancer_for, stage_settings

NUM_STAGES = 4


def whole_model_reference(mb):
    model = build_gpt(PRESETS["tiny"], seed=0)
    loss = model(mb.inputs, mb.targets)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def microbatch():
    return ByteBatcher(load_corpus(), seq_len=64, microbatch_size=4, seed=1).microbatch(0)


@pytest.mark.parametrize("routing", ["relay", "chain"])
@pytest.mark.parametrize("codec", ["fp32", "int8"])
async def test_split_model_matches_whole_model(codec, routing, microbatch, start_stages, http_session):
    apps, urls = await start_stages([[stage_settings(s, wire_codec=codec)] for s in range(NUM_STAGES)])
    client = PipelineClient(http_session, balancer_for(urls), run_id="test", codec=codec, routing=routing)

    loss = (await client.train(microbatch, seed=0)).loss

    ref_loss, ref_grads = whole_model_reference(microbatch)
    grads = {}
    for group in apps:
        runtime = group[0][RUNTIME]
        assert runtime.pending_samples == microbatch.inputs.shape[0]
        assert runtime.stats.optimizer_steps == 0
        grads.update(runtime.accumulated_gradients())
    assert grads.keys() == ref_grads.keys()  # the stages together hold exactly the whole model

    if codec == "fp32":
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name, ref in ref_grads.items():
            rel = (grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)
            assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"
    else:
        assert abs(loss - ref_loss) / ref_loss <= 0.01
        for name, ref in ref_grads.items():
            cos = F.cosine_similarity(grads[name].flatten(), ref.flatten(), dim=0)
            assert cos > 0.99, f"{name}: cosine similarity {cos:.4f}"


async def test_backward_on_a_replica_that_never_saw_the_forward(microbatch, start_stages, http_session):
    """Stateless backward: replica B recomputes the forward that replica A cached; same result."""
    settings = stage_settings(1)
    apps, urls = await start_stages([[settings, settings]])  # two replicas of stage 1, same weights
    (app_a, app_b), (url_a, url_b) = apps[0], urls[0]

    hidden = torch.randn(4, 64, PRESETS["tiny"].d_model)
    grad_out = torch.randn_like(hidden)
    base = {
        "run_id": "test",
        "stage": 1,
        "microbatch_id": "mb-1",
        "seed": 7,
        "codec": "fp32",
        "inputs": encode_tensor(hidden, "fp32"),
    }

    forward = await post_message(http_session, url_a + "/forward", base, timeout_s=30)
    assert decode_tensor(forward["outputs"]).shape == hidden.shape
    backward_msg = {**base, "grad_outputs": encode_tensor(grad_out, "fp32")}
    on_a = await post_message(http_session, url_a + "/backward", backward_msg, timeout_s=30)
    on_b = await post_message(http_session, url_b + "/backward", backward_msg, timeout_s=30)

    runtime_a, runtime_b = app_a[RUNTIME], app_b[RUNTIME]
    assert runtime_a.stats.cache_hits == 1 and runtime_b.stats.cache_hits == 0  # both paths ran
    assert torch.equal(decode_tensor(on_a["grad_inputs"]), decode_tensor(on_b["grad_inputs"]))
    grads_a, grads_b = runtime_a.accumulated_gradients(), runtime_b.accumulated_gradients()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
