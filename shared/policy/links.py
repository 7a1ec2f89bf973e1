"""Slow links out of the weakest stage: the exchange of two replicas of about one speed.

Every global step a stage's replicas all-reduce its gradient at the pace of the slowest
link among them, and the next step starts once every stage took this one: a slow link in
the swarm's weakest stage (whose compute is the swarm's pace, with no replica to spare)
adds its round's tail to every step, while beside a stage's compute to spare it costs
little (there it is a hot spare, :mod:`shared.policy.spares`, or its round has slack).
The join rule already sends a slow-link joiner to the strongest stage of its need
(:func:`~shared.policy.resilience.join_stage`), but need comes first: a slow-link peer
that is the first of its kind to ask fills an empty stage, and stays there (the arena's
10 Mbit/s peer asking first of the 2-unit ones: the weakest stage's round held to
0.8-0.9 s a step).

:func:`link_exchange` undoes that once the swarm has formed: a replica on a slow link
(:func:`~shared.policy.resilience.slow_link`) in the weakest stage changes places with a
replica of about its speed (within ``LINK_EXCHANGE_TOLERANCE``) on a link that is not slow,
from a stronger stage, so that the stronger stage stays the stronger. Capacities barely
move (no throughput rule undoes it), the weakest stage's round runs on fast links, and
no exchange ever brings a slow link back into the weakest stage (so exchanges end).
The replica joining the weakest stage moves first; the slow one leaves once it serves
there (the coordinator orders them in turn), so the weakest stage never runs a replica
short. Only as the swarm forms (no replica has served: every throughput 0): a move in a
swarm that trains costs the mover a resync on its first backward (its downloaded state is
steps old by the time it registers: a 6 s stall in the arena), and under churn the
exchanges came between kills. Speeds are the declared ones (every replica must have
declared one, :meth:`~shared.policy.view.SwarmView.replica_speeds`); links count only where
every replica declared one. Pure logic.
"""

from __future__ import annotations

from shared.policy.move import Move
from shared.policy.resilience import slow_link
from shared.policy.view import SwarmView

# "about one speed": within this fraction of the faster one's. Declared speeds are half a second
# of matrix products beside other processes: the arena's peers of one CPU cap declared 16.0-20.4
# GFLOP/s (2-unit caps) and 35-49 (4-unit caps), up to 29% apart.
LINK_EXCHANGE_TOLERANCE = 0.3


def link_exchange(view: SwarmView) -> tuple[Move, Move] | None:
    """The exchange that takes a slow link out of the weakest stage: ``(the fast-linked
    replica's move into it, the slow one's move out)``, or None (also once a replica has
    served, while joins are pending, a stage has no replica, or speeds or links are not
    known for every replica).

    Of the slow replicas of the weakest stage, the slowest link first; of their partners,
    the strongest stage's, then the fastest link, then the closest speed, then the lowest id."""
    if view.pending:
        return None  # servers still joining (or moving): the stages are not formed yet
    if any(r.throughput > 0 for r in view.replicas):
        return None  # the swarm has trained: a move now costs a resync stall (see the module's docstring)
    known = view.replica_speeds()
    links = [r.link_mbit for r in view.replicas]
    if known is None or not all(v > 0 for v in links):
        return None
    value, unit = known
    capacity = [0.0] * view.num_stages
    counts = [0] * view.num_stages
    for r in view.replicas:
        capacity[r.stage] += value[r.server_id]
        counts[r.stage] += 1
    if not all(counts):
        return None
    pace = min(range(view.num_stages), key=lambda s: (capacity[s], s))
    best: tuple | None = None
    for a in view.replicas:
        if a.stage != pace or slow_link(a.link_mbit, links) is None:
            continue
        for b in view.replicas:
            if b.stage == pace or b.link_mbit <= a.link_mbit or slow_link(b.link_mbit, links) is not None:
                continue
            va, vb = value[a.server_id], value[b.server_id]
            if abs(va - vb) > LINK_EXCHANGE_TOLERANCE * max(va, vb):
                continue
            if capacity[b.stage] - vb + va <= capacity[pace] - va + vb:
                continue  # the stronger stage must stay the stronger: the slow link is never back in the weakest
            key = (a.link_mbit, -capacity[b.stage], -b.link_mbit, abs(va - vb), b.server_id, a.server_id)
            if best is None or key < best[0]:
                best = (key, a, b)
    if best is None:
        return None
    _, a, b = best
    median = slow_link(a.link_mbit, links)
    reason = (
        f"an exchange of {b.server_id} (stage {b.stage}, {b.link_mbit:g} Mbit/s) with {a.server_id} "
        f"(stage {pace}, {a.link_mbit:g} Mbit/s, a slow link: the swarm's median {median:g} Mbit/s) takes the slow "
        f"link out of the weakest stage ({capacity[pace]:.3g} {unit}); their speeds are within "
        f"{LINK_EXCHANGE_TOLERANCE:.0%} of each other"
    )
    return Move(b.server_id, b.stage, pace, reason=reason), Move(a.server_id, pace, b.stage, reason=reason)
