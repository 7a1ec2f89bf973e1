"""``swarm generate``: prompt in, text out, through the live swarm's stage servers.

Opens an inference session on one replica of every stage (``shared.inference``), streams
the text to stdout as tokens come, and tells on stderr how it went (tokens/s, failovers,
the weights' global steps). A server that fails mid-generation is replaced by another
replica of its stage and the session replayed into it: the text goes on, the same as
without the failure under greedy decoding.

The stages come from ``--coordinator`` (``SWARM_COORDINATOR``, else mDNS) or ``--stages``
(replica URLs, ',' between replicas and ';' between stages). The tokenizer is
``--tokenizer`` (``SWARM_TOKENIZER``), else the model directory's when the servers' model
is a Hugging Face directory that exists here, else bytes for the byte-level presets.
Requests are signed with the swarm secret (``SWARM_SECRET``/``SWARM_SECRET_FILE``).

Exit status: 0 generated; 1 the generation failed (no replica of a stage could serve it);
2 bad input, or no swarm found.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from shared.errors import RemoteError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="swarm generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", help="the text to continue ('-': read it from stdin)")
    p.add_argument(
        "--coordinator",
        default=env("SWARM_COORDINATOR", ""),
        help="coordinator URL (default: SWARM_COORDINATOR, else mDNS)",
    )
    p.add_argument(
        "--stages",
        default=env("SWARM_STAGES", ""),
        help="stage server URLs instead of a coordinator: replicas ',' stages ';'",
    )
    p.add_argument("--run-id", default=env("SWARM_RUN_ID"), help="with mDNS: the run to look for")
    p.add_argument("--mdns-interfaces", default=env("SWARM_MDNS_INTERFACES", "all"))
    p.add_argument(
        "--tokenizer",
        default=env("SWARM_TOKENIZER", ""),
        help="a Hugging Face tokenizer.json or a directory holding one",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); higher: more random")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="sample among the most likely tokens holding this much probability"
    )
    p.add_argument("--stop", action="append", default=[], help="end the text before this string (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (same seed, same text)")
    p.add_argument(
        "--codec",
        default="fp32",
        choices=["fp32", "fp16", "bf16", "int8", "int4"],
        help="wire codec of the hidden states (default fp32)",
    )
    p.add_argument("--timeout-s", type=float, default=30.0, help="timeout of each request to a stage server")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (text, tokens, stats) instead of streaming the text"
    )
    return p.parse_args(argv)


async def _stages_of(args, http) -> tuple[list[list[str]], str | None]:
    """Replica URLs per stage, and the coordinator's URL (None with --stages)."""
    from shared.http import get_json

    if args.stages:
        return [
            [u.strip().rstrip("/") for u in group.split(",") if u.strip()] for group in args.stages.split(";")
        ], None
    coordinator = args.coordinator
    if not coordinator:
        from shared.discovery import find_coordinator

        coordinator = await find_coordinator(args.run_id, interfaces_spec=args.mdns_interfaces, timeout_s=5.0) or ""
    if not coordinator:
        raise LookupError("no coordinator given (--coordinator, SWARM_COORDINATOR) or --stages, and none found by mDNS")
    coordinator = coordinator.rstrip("/")
    view = await get_json(http, coordinator + "/swarm", timeout_s=10.0)
    return [[r["url"] for r in s["replicas"]] for s in view["stages"]], coordinator


async def run(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    from shared.config import CommonSettings
    from shared.hf import is_hf_dir
    from shared.http import get_json, swarm_session
    from shared.inference import SamplingParams, SessionFailed, SwarmSession, TextStream, generate
    from shared.model import config_from_dict
    from shared.tokenizer import HFTokenizer, load_tokenizer
    from shared.wiring import ReplicaBalancer

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop=tuple(args.stop),
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"swarm generate: {exc}", file=err)
        return 2
    async with swarm_session(CommonSettings()) as http:
        try:
            stages, coordinator = await _stages_of(args, http)
            if not stages or not all(stages):
                raise LookupError(f"a stage has no replica: {[len(s) for s in stages]} replicas per stage")
            info = await get_json(http, stages[0][0] + "/info", timeout_s=10.0)
            cfg = config_from_dict(info["model_config"])
            if info["num_stages"] != len(stages):
                raise LookupError(f"the servers cut the model into {info['num_stages']} stages, {len(stages)} listed")
            tokenizer = (
                HFTokenizer(args.tokenizer)
                if args.tokenizer
                else load_tokenizer(info["model"] if is_hf_dir(info["model"]) else "", "", cfg)
            )
            ids = tokenizer.encode_batch([prompt])[0]
            if not ids:
                raise ValueError("the prompt is empty")
            if len(ids) + params.max_tokens > cfg.block_size:
                raise ValueError(
                    f"{len(ids)} prompt tokens + --max-tokens {params.max_tokens} "
                    f"exceed the model's {cfg.block_size} positions"
                )
        except (LookupError, ValueError, KeyError, RemoteError) as exc:
            print(f"swarm generate: {exc}", file=err)
            return 2
        balancer = ReplicaBalancer(len(stages))
        for s, urls in enumerate(stages):
            balancer.set_replicas(s, urls)

        async def refresh():
            if coordinator:
                try:
                    for s, urls in enumerate((await _stages_of(args, http))[0]):
                        if urls:
                            balancer.set_replicas(s, urls)
                except (RemoteError, KeyError, LookupError):
                    pass

        stream = TextStream(tokenizer.decode, params.stop)
        tokens: list[int] = []
        started = time.perf_counter()
        session = SwarmSession(
            http,
            balancer,
            run_id=info["run_id"],
            max_length=len(ids) + params.max_tokens,
            codec=args.codec,
            timeout_s=args.timeout_s,
            refresh=refresh,
        )
        try:
            async with session:
                async for token in generate(session.step, ids, params, eos_id=tokenizer.eos_id):
                    tokens.append(token)
                    piece = stream.push(token)
                    if piece and not args.json:
                        out.write(piece)
                        out.flush()
                    if stream.stopped:
                        break
        except (SessionFailed, RemoteError) as exc:
            print(f"\nswarm generate: the generation failed after {len(tokens)} tokens: {exc}", file=err)
            return 1
        tail = stream.flush()
        elapsed = time.perf_counter() - started
        stats = {
            "prompt_tokens": len(ids),
            "tokens": len(tokens),
            "seconds": round(elapsed, 3),
            "tokens_per_s": round(len(tokens) / elapsed, 2) if elapsed else None,
            "finish_reason": "length" if len(tokens) == params.max_tokens and not stream.stopped else "stop",
            **session.stats.to_dict(),
        }
        if args.json:
            out.write(json.dumps({"text": stream.out, "token_ids": tokens, **stats}) + "\n")
        else:
            out.write(tail + "\n")
            print(
                (
                    f"[{stats['tokens']} tokens in {elapsed:.2f} s, {stats['tokens_per_s']} tokens/s; failovers "
                    f"{stats['failovers']}; weights at global step(s) {stats['weights_steps']}]"
                ),
                file=err,
            )
        return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
