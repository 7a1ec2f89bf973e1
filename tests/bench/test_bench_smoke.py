"""Smoke run of every bench at tiny sizes: ``swarm bench NAME... --quick`` runs them from one
command, writes each one's JSON with the fields the docs quote, and leaves no process
behind. The figures of a quick run mean nothing; only that they are sane is checked.

The arena is the one bench not run here: ``tests/bench/test_arena.py`` runs its quick
scenario and checks everything this file would (and more), so running it twice cost 37 s
of the suite for nothing; ``bench all`` is checked to mean these benches and the arena."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.e2e.conftest import SWARM, run_bench

pytestmark = pytest.mark.e2e

# hivemind is the optional `bench` extra: measured where installed, "not installed" in the tables elsewhere (CI)
HIVEMIND = importlib.util.find_spec("hivemind") is not None
BENCHES = ("codec", "hop", "square_cube", "pipelining", "churn", "rebalancing", "convergence", "generation", "joins")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench")
    status, output = run_bench(
        [*SWARM, "bench", *BENCHES, "--quick", "--out", str(out), "--markdown", str(out / "tables.md")], 400
    )
    print(output[-6000:])
    assert status == 0, output[-4000:]
    assert (out / "tables.md").read_text().count("### ") == len(BENCHES)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in BENCHES}


def rows(results, name: str) -> list[dict]:
    record = results[name]
    assert record["bench"] == name and record["quick"] is True and record["command"].startswith("swarm bench")
    assert record["machine"]["cores"] >= 1 and record["machine"]["torch"] and record["machine"]["date_utc"]
    assert record["rows"] and record["columns"] != ["error"], record["rows"]
    return record["rows"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_codec(results):
    table = rows(results, "codec")
    codecs = {r["codec"] for r in table}
    assert {"memcpy", "fp32", "fp16", "bf16", "int8", "hivemind 8-bit"} <= codecs
    for r in table:
        if r["codec"] in ("fp32", "fp16", "bf16", "int8"):
            assert positive(r["MB/s"]) and positive(r["x memcpy"])
            assert r["rel. error"] < {"fp32": 1e-7, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.05}[r["codec"]]
        if r["codec"] == "int8":
            assert r["fp32/wire"] > 3.9
        if r["codec"] == "int4":
            assert r["fp32/wire"] >= 7.5 and r["rel. error"] < 0.15
    hivemind = [r for r in table if r["codec"] == "hivemind 8-bit"]
    if HIVEMIND:  # one row per size, bitsandbytes' dynamic map underneath: int8's bounds
        assert [r["MiB"] for r in hivemind] == [r["MiB"] for r in table if r["codec"] == "int8"]
        for r in hivemind:
            assert positive(r["MB/s"]) and positive(r["MB/s, buffers recycled"])
            assert r["rel. error"] < 0.05 and r["fp32/wire"] > 3.9
    else:
        assert [r["MiB"] for r in hivemind] == ["all"] and hivemind[0]["MB/s"] == "not installed"
    assert results["codec"]["summary"]["hivemind"] == ("measured" if HIVEMIND else "not installed")


def test_hop(results):
    for r in rows(results, "hop"):
        assert positive(r["hop ms"]) and positive(r["compute ms"]) and r["compute ms"] < r["hop ms"]
        assert positive(r["hops/s"]) and positive(r["hops/s x4"]) and 0 < r["other share"] < 1
        if HIVEMIND:  # its RemoteExpert called as many times on the same stage and tensors
            assert positive(r["hivemind hop ms"]) and positive(r["hivemind / mesh"]), r
        else:
            assert r["hivemind hop ms"] == r["hivemind / mesh"] == "not installed"
    assert results["hop"]["summary"]["hivemind"] == ("measured" if HIVEMIND else "not installed")


def test_square_cube(results):
    for r in rows(results, "square_cube"):
        assert positive(r["mesh tok/s"]) and positive(r["1 process tok/s"]) and positive(r["mesh / 1 process"])
        shares = [r[f"{part} share"] for part in ("compute", "recompute", "comm", "idle", "others")]
        assert all(s >= 0 for s in shares) and (
            0.99 < sum(shares) < 1.01 or r["idle share"] == r["others share"] == 0
        ), r  # all of the cores, or more (CPU clock ticks in a tiny window)
        assert positive(r["mesh MFU"]) and positive(r["1 process MFU"]) and all(map(positive, r["stage busy MFUs"]))


def test_pipelining(results):
    for r in rows(results, "pipelining"):
        assert positive(r["pipelining tok/s"]), f"torch.distributed.pipelining did not run: {r['pipelining tok/s']}"
        assert positive(r["mesh / pipelining"]) and positive(r["mesh tok/s"])
    first = results["pipelining"]["rows"][0]["loss check"]
    pipelined, single = first.split(" in ")[0].split(" vs ")
    assert abs(float(pipelined) - float(single)) < 1e-3, first  # the same model on both sides


def test_churn(results):
    calm, faulty = rows(results, "churn")
    assert positive(calm["tokens/s"]) and positive(faulty["tokens/s"]) and positive(faulty["vs no faults"])
    assert faulty["kills"] >= 1
    assert (
        calm["lost microbatches"] == faulty["lost microbatches"] == 0
    )  # a killed replica's microbatches are re-run, never lost
    assert results["churn"]["summary"]["lost_microbatches"] == faulty["lost microbatches"]


def test_rebalancing(results):
    before, after, best = rows(results, "rebalancing")
    assert positive(before["tokens/s"]) and positive(best["tokens/s"])
    assert after["moves"] >= 1 and positive(after["tokens/s"]), "the coordinator made no move"
    assert best["stage speeds"] == "[1, 2] | [4]"


def test_convergence(results):
    table = rows(results, "convergence")
    assert [(r["wire"], r["replicas/stage"], r["trainers"], r["sync"]) for r in table] == [
        ("fp32", 1, 1, "global"),
        ("fp32 (again)", 1, 1, "global"),
        ("fp32", 2, 2, "global"),
        ("fp32", 2, 2, "local"),
        ("fp16", 1, 1, "global"),
        ("int8", 1, 1, "global"),
        ("int8", 2, 2, "global"),
        ("int4", 1, 1, "global"),
    ]
    by = {(r["wire"], r["replicas/stage"], r["sync"]): r for r in table}
    assert by[("fp32", 1, "global")]["sync bytes/sample"] == 0  # one replica per stage: nothing to all-reduce
    # local mode (an outer step every 2 of the quick plan's 4 steps) sends fewer bytes than an all-reduce every step
    assert 0 < by[("fp32", 2, "local")]["sync bytes/sample"] < by[("fp32", 2, "global")]["sync bytes/sample"]
    assert (
        len({r["global steps"] for r in table}) == 1
    )  # every swarm took the same global steps of the same global batch
    assert all(
        r["samples"] >= table[0]["samples"] for r in table
    )  # two trainers may compute a few microbatches past the last step
    for r in table:
        assert positive(r["loss after"]) and r["loss after"] < r["loss before"]


def test_generation(results):
    table = rows(results, "generation")
    assert {(r["context"], r["way"]) for r in table} == {
        (c, w) for c in (8, 64) for w in ("session (KV cache)", "no cache (whole prefix)")
    }
    for r in table:
        assert positive(r["ms/token"]) and positive(r["tokens/s"]) and r["steps"] == 3
    at_64 = {r["way"]: r for r in table if r["context"] == 64}
    assert at_64["no cache (whole prefix)"]["x session"] > 1  # 64 positions recomputed per token cost more than one
    assert isinstance(at_64["no cache (whole prefix)"]["same tokens"], bool)


def test_joins(results):
    """A cold server and a standby (``--stage standby``, handed the stage whose replica was
    killed) each served a microbatch of the training swarm; the times are sane, not quoted."""
    table = {r["join"].split()[0]: r for r in rows(results, "joins")}
    assert set(table) == {"cold", "standby"}
    for kind, r in table.items():
        assert r["runs"] == 2 and 0 < r["min s"] <= r["median s"] <= r["max s"] < 60, r
        assert 0 < r["listening (median s)"] <= r["median s"] and r["target s"] == {"cold": 6, "standby": 2}[kind]
    summary = results["joins"]["summary"]
    assert len(summary["standby_runs_s"]) == 2 and summary["standby_median_s"] == table["standby"]["median s"]


def test_bench_all_is_these_benches_and_the_arena():
    from bench.__main__ import parse_args

    assert parse_args(["all", "--quick"]).names == [*BENCHES, "arena"]
