"""A stage that lost every replica recovers from its newest state the checkpointer saved, not
from the last checkpoint every stage made: a checkpoint is committed only when every stage
gives its state, and under churn a stage often has none to give, so the last full checkpoint
can be far behind (the churn arena found a stage sent back from step 30 to step 7)."""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from services.coordinator.app import create_app as create_coordinator
from services.coordinator.checkpointer import Checkpointer
from services.coordinator.registry import Registry
from services.coordinator.steps import STEPS
from services.stage_server.app import create_app
from services.stage_server.routes import RUNTIME
from services.stage_server.state import stage_state, state_to_bytes
from shared import checkpoint
from tests.conftest import coordinator_settings, stage_settings
from tests.unit.test_checkpoint import CFG, NUM_STAGES, assert_same, params, runtime, train


class Recorder:
    def __init__(self):
        self.warnings: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.warnings.append((event, fields))

    def info(self, event: str, **fields) -> None:
        pass


async def test_a_checkpoint_a_stage_could_not_give_keeps_the_others_states_and_a_recovery_takes_the_newest(tmp_path):
    stages = [runtime(s, global_batch=2) for s in range(NUM_STAGES)]
    for rt in stages:
        train(rt, [rt.spec.index])  # global step 1 everywhere
    for index, rt in enumerate(stages):
        checkpoint.write_stage_file(tmp_path, 1, index, state_to_bytes(*stage_state(rt)))
    checkpoint.commit_checkpoint(
        tmp_path, 1, {"run_id": "test", "num_stages": NUM_STAGES, "model_config": CFG.to_dict()}
    )
    for rt in stages:
        train(rt, [10 + rt.spec.index])  # global step 2: stage 3 will have no state to give

    # The checkpointer's next try: every stage but 3 gives its state of step 2.
    registry = Registry(":memory:", num_stages=NUM_STAGES, heartbeat_s=60.0)
    for stage in range(NUM_STAGES):
        registry.register(f"s{stage}", stage, f"http://127.0.0.1:{9100 + stage}", "v", 1.0, 0)
    log = Recorder()
    checkpointer = Checkpointer(registry, root=str(tmp_path), run_id="test", keep=2, timeout_s=5.0, log=log)

    async def download(stage: int, urls: list[str], step: int) -> bytes | None:
        return None if stage == 3 else state_to_bytes(*stage_state(stages[stage]))

    checkpointer._download = download
    assert await checkpointer.checkpoint_once() is None
    assert checkpoint.read_meta(checkpoint.latest_checkpoint(tmp_path))["step"] == 1  # nothing committed
    assert log.warnings == [
        (
            "checkpoint.skipped",
            {"stage": 3, "missing": [3], "reason": "no live replica gave its state", "kept_newest": [0, 1, 2]},
        )
    ]
    assert [checkpoint.newest_stage_file(tmp_path, s, not_past=2)[1] for s in range(NUM_STAGES)] == [2, 2, 2, 1]

    # Stage 1 then loses every replica: a server started for it takes its state of step 2, the
    # stage's step in the swarm; a swarm resumed at step 1 takes the checkpoint's.
    coordinator_app = create_coordinator(coordinator_settings(run_id="test", num_stages=NUM_STAGES))
    coordinator = TestServer(coordinator_app, host="127.0.0.1")
    await coordinator.start_server()
    try:
        for swarm_step, expected in ((1, 1), (2, 2)):
            coordinator_app[STEPS].counter.stages[1].step = swarm_step
            settings = stage_settings(
                1,
                num_stages=NUM_STAGES,
                seed=5,
                checkpoint_dir=str(tmp_path),
                coordinator=str(coordinator.make_url("")).rstrip("/"),
            )
            app = create_app(settings)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            try:
                recovered = app[RUNTIME]
                assert recovered.stats.optimizer_steps == expected
                if expected == 2:
                    assert_same(params(recovered), params(stages[1]))
            finally:
                await server.close()
    finally:
        await coordinator.close()
