"""The runtime: the public schedules and the per-rank driver that carries out a plan.

- :mod:`.stage` (``PipelineStage``) and :mod:`.schedules` (``ScheduleMPipeTranspose``,
  ``ScheduleInterleaved1F1B``, one base for both, their options declared once in
  :mod:`.options`) are the training API: they check their arguments before any rank
  communicates, and on the first ``run()`` build the plan, the executor, the transport and the
  receive buffers, and check that every rank was set up alike (:mod:`.handshake`, comparing the
  facts of :mod:`.setup_facts`).
- :mod:`.driver` (``RankRuntime``) walks this rank's order one step at a time: compute through
  the executor hooks, messages through the transport, tensors handed between steps through
  the per-step caches of :mod:`.state`; receive buffers (:mod:`.buffers`) go back to the pool
  after their last reader. A failing step aborts cleanly and names rank, step and peer.
- :mod:`.microbatch` cuts the global batch; :mod:`.grad_reduce` makes ``GRADreduce`` reduce
  only what the current step added.

``docs/architecture.md``, "How a step flows" has the table of what each step does here.
Nothing is imported eagerly: the public names load from ``graph_exec`` on first use.
"""
