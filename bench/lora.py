"""Full fine-tuning against LoRA on one model, in one run: ``python -m bench.lora``.

Writes a random Llama as a Hugging Face model directory (``--d-model`` wide, 4 layers; no
``transformers`` needed), then trains it ``--steps`` global steps twice through the same
swarm shape (2 stages x 2 replicas, the real coordinator, stage servers and trainer, in this
process on loopback): once every weight, once LoRA of ``--rank`` on ``--targets`` (default
the attention's query and value projections). For each it reports the bytes the stage
servers sent in step rounds per global step (all servers together: the all-reduce of each
stage's gradient between its replicas), and per stage server the trainable parameters, the
bytes of the fp32 weights that train, of AdamW's state and of the frozen base, the memory
estimate the server checks at start, and whether the replicas of each stage ended with equal
digests. JSON to ``--out``/lora.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from shared.llama import LlamaConfig

LAYERS, SEQ_LEN, MICROBATCH = 4, 32, 4


def write_model(path: Path, d_model: int, seed: int = 0) -> Path:
    """A random Llama of width ``d_model`` as a Hugging Face directory (config.json, model.safetensors)."""
    from shared.hf import save_hf
    from shared.model import build_model

    cfg = LlamaConfig(
        vocab_size=320,
        block_size=64,
        n_layer=LAYERS,
        n_head=4,
        n_kv_head=2,
        d_model=d_model,
        ffn_dim=int(d_model * 8 / 3) // 16 * 16,
    )
    model = build_model(cfg, seed)
    save_hf(path, {n: p.detach() for n, p in model.named_parameters()}, cfg, max_shard_bytes=2**40)
    return path


async def _serve(app: web.Application, runners: list[web.AppRunner], port: int) -> str:
    """Serve ``app`` on loopback at ``port`` (a stage server registers the URL it listens at)."""
    runner = web.AppRunner(app)
    await runner.setup()
    runners.append(runner)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}"


def server_memory(runtime, settings) -> dict:
    """What one stage server holds for training: trainable weights, AdamW state, the frozen base."""
    from services.stage_server.memory import check_stage_memory

    trainable = sum(p.numel() for p in runtime.params)
    ids = {id(p) for p in runtime.params}
    base = [t for t in (*runtime.model.parameters(), *runtime.model.buffers()) if id(t) not in ids]
    adam = sum(
        v.numel() * v.element_size() for s in runtime.optimizer.state.values() for v in s.values() if v.dim() > 0
    )
    return {
        "trainable_parameters": trainable,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in runtime.params),
        "adam_bytes": adam,
        "frozen_base_bytes": sum(t.numel() * t.element_size() for t in base) if runtime.lora is not None else 0,
        "estimate_bytes": check_stage_memory(
            runtime.cfg,
            runtime.spec,
            "cpu",
            max_staleness=settings.max_staleness,
            free_bytes=2**62,
            lora=settings.lora.config(),
        ),
    }


async def measure(
    model_dir: Path,
    *,
    steps: int,
    lora_rank: int = 0,
    targets: str = "all-linear",
    stages: int = 2,
    replicas: int = 2,
    global_batch: int = 8,
    lr: float = 1e-3,
) -> dict:
    """Train ``steps`` global steps of ``model_dir`` through ``stages x replicas`` servers."""
    from services.coordinator.app import STEPS
    from services.coordinator.app import create_app as create_coordinator
    from services.stage_server.allreduce import AVERAGER
    from services.stage_server.app import MEMBERSHIP, create_app
    from services.stage_server.routes import RUNTIME, SETTINGS
    from services.trainer.admission import AdmissionClient
    from services.trainer.data import ByteBatcher, load_corpus
    from services.trainer.pipeline import PipelineClient
    from services.trainer.trainer import Trainer
    from shared.config import CoordinatorSettings, StageServerSettings
    from shared.processes import free_port
    from shared.wiring import ReplicaBalancer

    run_id = "bench-lora"
    runners: list[web.AppRunner] = []
    try:
        coordinator_app = create_coordinator(
            CoordinatorSettings(
                run_id=run_id,
                num_stages=stages,
                heartbeat_s=60.0,
                state_db=":memory:",
                mdns=False,
                coordinator="",
                average_every_s=0,
                rebalance_every_s=0,
            )
        )
        coordinator = await _serve(coordinator_app, runners, free_port())
        apps: list[list[web.Application]] = []
        urls: list[list[str]] = []
        for stage in range(stages):
            apps.append([]), urls.append([])
            for _ in range(replicas):
                port = free_port()
                settings = StageServerSettings(
                    model=str(model_dir),
                    num_stages=stages,
                    stage=stage,
                    coordinator=coordinator,
                    port=port,
                    run_id=run_id,
                    mdns=False,
                    heartbeat_s=60.0,
                    wire_codec="fp32",
                    global_batch=global_batch,
                    lr=lr,
                    warmup_steps=0,
                    lora_rank=lora_rank,
                    lora_target_modules=targets,
                )
                app = create_app(settings)
                apps[-1].append(app), urls[-1].append(await _serve(app, runners, port))
        for app in (a for group in apps for a in group):
            await asyncio.wait_for(app[MEMBERSHIP].registered.wait(), 30)
        async with aiohttp.ClientSession() as session:
            balancer = ReplicaBalancer(stages, rng=random.Random(0))
            for stage, group in enumerate(urls):
                balancer.set_replicas(stage, group)
            client = PipelineClient(session, balancer, run_id=run_id, codec="fp32", until_step=steps, client_id="bench")
            trainer = Trainer(
                client,
                ByteBatcher(load_corpus(), SEQ_LEN, MICROBATCH, seed=0),
                steps=steps,
                global_batch=global_batch,
                in_flight=2,
                eval_microbatches=2,
                admission=AdmissionClient(session, coordinator, run_id=run_id, until_step=steps, wait_s=60),
            )
            summary = await trainer.run()
            for app in (a for group in apps for a in group):
                averager = app[AVERAGER]
                if averager.running:
                    await averager.wait_round(averager.round.spec.round_id, 30)
            await coordinator_app[STEPS].settled()
        servers = [
            {"stage": stage, **server_memory(app[RUNTIME], app[SETTINGS])}
            for stage, group in enumerate(apps)
            for app in group
        ]
        sent = sum(app[AVERAGER].bytes_sent for group in apps for app in group)
        return {
            "lora_rank": lora_rank,
            "targets": targets if lora_rank else "",
            "steps": steps,
            "stage_steps": [[app[RUNTIME].step for app in group] for group in apps],
            "step_round_bytes_per_step": sent / steps,
            "replicas_identical": all(len({app[RUNTIME].digest() for app in group}) == 1 for group in apps),
            "eval_loss_before": summary.eval_loss_before,
            "eval_loss_after": summary.eval_loss_after,
            "microbatches_failed": summary.microbatches_failed,
            "servers": servers,
        }
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def compare(model_dir: Path, *, steps: int, rank: int, targets: str) -> dict:
    full = await measure(model_dir, steps=steps)
    lora = await measure(model_dir, steps=steps, lora_rank=rank, targets=targets, lr=1e-2)
    return {
        "full": full,
        "lora": lora,
        "bytes_ratio": full["step_round_bytes_per_step"] / max(lora["step_round_bytes_per_step"], 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256, help="width of the random Llama (default 256)")
    p.add_argument("--steps", type=int, default=10, help="global steps of each run (default 10)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--out", default="bench/results", help="directory of the JSON result (lora.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model_dir = write_model(Path(tmp) / "model", args.d_model)
        result = asyncio.run(compare(model_dir, steps=args.steps, rank=args.rank, targets=args.targets))
    print(f"{'run':<28} {'step-round bytes/step':>22} {'trainable/server':>17} {'AdamW B':>10} {'estimate MiB':>13}")
    for name in ("full", "lora"):
        r = result[name]
        label = "full fine-tuning" if name == "full" else f"LoRA r={r['lora_rank']} {r['targets']}"
        s = r["servers"][0]
        print(
            f"{label:<28} {r['step_round_bytes_per_step']:>22,.0f} {s['trainable_parameters']:>17,} "
            f"{s['adam_bytes']:>10,} {s['estimate_bytes'] / 2**20:>13.1f}"
        )
    print(f"full / LoRA step-round bytes: {result['bytes_ratio']:.1f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps({"params": vars(args), **result}, indent=1))
    ok = all(result[n]["replicas_identical"] and result[n]["microbatches_failed"] == 0 for n in ("full", "lora"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
