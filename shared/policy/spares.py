"""Hot spares: the replicas whose stage does not need their compute, kept out of routing.

Under synchronous global steps every replica that holds samples of a step takes a full
part in its stage's step round: it compresses its whole gradient, sends it, and waits for
the others' over its own link. A member that holds none sends its weight without values
and reduces a tenth of a part (``averaging.round_shares``), so its round costs little. A
weak replica on a stage that is not the swarm's bottleneck gains the swarm nothing (the
pipeline runs at its weakest stage's pace) and costs its stage a full round: in the
heterogeneous arena the stage-0 and stage-1 rounds took 0.16-0.28 s a step while their
peers of a fifteenth of a core held no samples and 0.5-1.0 s once they did.

So a replica is a *hot spare* while its stage keeps, without it, at least the weakest
stage's capacity less ``SPARE_TOLERANCE`` of it (declared speeds are half a second of
matrix products beside other processes: the arena's peers of one CPU cap declared 35-49
GFLOP/s). It stays a member of every step round (its weights and AdamW state identical to
its stage's), routing leaves it out, and it serves the moment its stage needs it (its
partner failed or was banned: the trainers' wiring falls back to it; it stops being a
spare as soon as its stage's capacity without it falls under that, e.g. when its partner
leaves). The weakest replicas of a stage become spares first; a stage keeps at least one
replica that is not. The weakest stage has none: its compute is the swarm's pace.

Capacities are the replicas' declared compute speeds where every replica declared one
(as the join rule ranks them: :meth:`~shared.policy.view.SwarmView.join_members`), else
their measured throughputs where every replica has measured one (a spare's throughput,
samples per busy second, keeps its last value), else there are no spares. Pure logic.
"""

from __future__ import annotations

from shared.policy.view import SwarmView

SPARE_TOLERANCE = 0.2  # a spare's stage keeps at least (1 - this) of the weakest stage's capacity


def spare_replicas(view: SwarmView) -> dict[str, str]:
    """``{server_id: why}`` for the hot spares of ``view`` (pending joins are not serving and
    count for nothing); empty unless every stage has a replica and every replica's speed is
    known (declared, else measured)."""
    known = view.replica_speeds()
    if known is None:
        return {}
    value, unit = known
    stages: list[list[str]] = [[] for _ in range(view.num_stages)]
    for r in view.replicas:
        stages[r.stage].append(r.server_id)
    if not all(stages):
        return {}
    capacity = [sum(value[sid] for sid in members) for members in stages]
    pace = min(range(view.num_stages), key=lambda s: (capacity[s], s))  # the weakest stage
    weakest = capacity[pace]
    spares: dict[str, str] = {}
    for stage, members in enumerate(stages):
        if stage == pace:
            continue
        left = capacity[stage]
        for sid in sorted(members, key=lambda s: (value[s], s))[:-1]:  # the strongest one always serves
            if left - value[sid] < (1 - SPARE_TOLERANCE) * weakest:
                break
            left -= value[sid]
            spares[sid] = (
                f"stage {stage} keeps {left:.3g} {unit} without it, about the weakest stage's {weakest:.3g} or more: "
                "its compute would gain the swarm nothing and cost its stage a full step round"
            )
    return spares
