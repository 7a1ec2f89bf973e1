"""Parity in: a Hugging Face model directory served by 4 stage servers over HTTP (fp32 wire)
computes the logits, loss and gradients ``transformers`` computes, each server having read
only its own layers' tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.stage_server.routes import RUNTIME
from services.trainer.data import Microbatch
from services.trainer.pipeline import PipelineClient
from shared.codec import decode_tensor, encode_tensor
from shared.hf import hf_name, read_hf_config
from shared.http import post_message
from tests.conftest import balancer_for, stage_settings
from tests.hf_models import VOCAB, gpt2_config, llama_config, load_model, save_model_dir

transformers = pytest.importorskip("transformers")
NUM_STAGES = 4
TOLERANCE = 1e-4  # relative, fp32


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory):
    config = llama_config() if request.param == "llama" else gpt2_config()
    return save_model_dir(tmp_path_factory.mktemp(request.param), config, max_shard_size="100KB")


@pytest.fixture(scope="module")
def microbatch():
    ids = torch.randint(0, VOCAB, (3, 33), generator=torch.Generator().manual_seed(5))
    return Microbatch(0, ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


async def test_swarm_of_a_model_directory_computes_transformers_logits_loss_and_gradients(
    model_dir, microbatch, start_stages, http_session
):
    apps, urls = await start_stages([[stage_settings(s, model=str(model_dir))] for s in range(NUM_STAGES)])
    runtimes = [group[0][RUNTIME] for group in apps]
    cfg = read_hf_config(model_dir)

    # each server read exactly its own layers' tensors (and the embedding / head where it holds them)
    for rt in runtimes:
        expected = {hf_name(cfg, n) for n, _ in rt.model.named_parameters()}
        if rt.spec.is_last and cfg.tie_embeddings:
            expected = (expected - {"lm_head.weight"}) | {hf_name(cfg, "wte.weight")}
        assert rt.load_report.names == expected
        layers = {int(n.split(".")[2]) for n in rt.load_report.names if ".h." in n or ".layers." in n}
        assert layers == set(rt.spec.layers)

    theirs = load_model(model_dir)
    ref_logits = theirs(microbatch.inputs).logits
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), microbatch.targets.reshape(-1))
    ref_loss.backward()

    # logits: hidden states over HTTP through stages 0..2, the last server's own model for the logits
    x = {"inputs": encode_tensor(microbatch.inputs, "raw")}
    for stage, url in enumerate(u[0] for u in urls[:-1]):
        reply = await post_message(
            http_session,
            url + "/forward",
            {
                "run_id": "test",
                "stage": stage,
                "microbatch_id": "logits",
                "seed": 0,
                "codec": "fp32",
                "eval": True,
                **x,
            },
            timeout_s=30,
        )
        x = {"inputs": reply["outputs"]}
    with torch.no_grad():
        logits = runtimes[-1].model(decode_tensor(x["inputs"]))
    assert relative(logits, ref_logits.detach()) < TOLERANCE

    # loss and gradients: one training microbatch through the 4 servers
    client = PipelineClient(http_session, balancer_for(urls), run_id="test", codec="fp32")
    loss = (await client.train(microbatch, seed=0)).loss
    assert abs(loss - ref_loss.item()) / ref_loss.item() < TOLERANCE
    their_grads = {name: p.grad for name, p in theirs.named_parameters()}
    ours = {name: g for rt in runtimes for name, g in rt.accumulated_gradients().items()}
    if (
        cfg.tie_embeddings
    ):  # transformers' one tied tensor gets both uses' gradients; our first and last stage hold one each
        ours["wte.weight"] = ours["wte.weight"] + ours.pop("lm_head.weight")
    assert len(ours) == len(their_grads)
    for name, grad in ours.items():
        ref = their_grads[hf_name(cfg, name)]
        ref = (
            ref.t()
            if cfg.family == "gpt"
            and name.startswith("blocks.")
            and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
            else ref
        )
        assert relative(grad, ref) < TOLERANCE, name
