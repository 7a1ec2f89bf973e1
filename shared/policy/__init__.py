"""The placement policy: which stage each server serves, and when one should move.

Pure decisions, no I/O, no aiohttp, no torch; every process that places or shows
servers reaches them here (the coordinator's rebalancing loop, registry, dashboard and
metrics, ``swarm status``, the simulator):

- :mod:`.move`: :class:`~.move.Move`, the one record of a decision (a leaf module: the
  topology planner emits moves too);
- :mod:`.view`: :class:`~.view.SwarmView`, what the rules decide on (stages, replicas
  with throughput and queue length, pending joins, topology inputs);
- :mod:`.resilience`: where a loss would hurt most: the stage a joiner takes
  (:func:`~.resilience.join_stage`), the replica floor no move goes below, and the move
  that repairs a stage under it (:func:`~.resilience.repair_move`);
- :mod:`.throughput`: the weakest-stage rule (:func:`~.throughput.weakest`), the
  best single move between stages (:func:`~.throughput.plan_move`) and, where every stage
  is at its replica floor, the best exchange of two replicas (:func:`~.throughput.plan_swap`);
- :mod:`.spares`: the hot spares, replicas whose stage does not need their compute
  (:func:`~.spares.spare_replicas`);
- :mod:`.links`: the exchange that takes a slow link out of the weakest stage
  (:func:`~.links.link_exchange`);
- :mod:`.hysteresis`: :class:`~.hysteresis.Confirmation`, a decision confirmed on
  consecutive checks before anyone acts on it;
- :mod:`.topology`: replans with the network cost model (:mod:`shared.topology`),
  never emptying a stage;
- :mod:`.rebalancing`: :meth:`RebalancingPolicy.check(view) -> moves
  <.rebalancing.RebalancingPolicy.check>`, the one entry point that picks the rule.

Import from the modules: this package re-exports nothing, because :mod:`shared.topology`
imports :mod:`.move` while :mod:`.topology` and :mod:`.rebalancing` import
:mod:`shared.topology`.
"""
