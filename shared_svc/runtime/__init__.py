"""One small controller runtime under both controllers (client-go's workqueue and
controller-runtime's Manager, cut to what shared-svc needs), on ``shared_svc.wait`` (the
loop helper and the rate limiters, which ``kube/`` uses too).

- :mod:`.workqueue`: a de-duplicating work queue with in-flight tracking, delayed adds,
  rate-limited adds and a bounded drain on shutdown;
- :mod:`.controller`: the :class:`~.controller.Controller` that runs workers over a
  queue, made from a :class:`~.controller.Reconciler` by
  :func:`~.controller.controller_for`;
- :mod:`.source`: event sources and their predicates (cache events to keys);
- :mod:`.manager`: the Manager that runs the runnables (the protocol is
  ``shared_svc.wait.runnable``'s), ``Periodic`` and ``Switched``;
- :mod:`.instrumentation`: controller-runtime's metric names, shared by every controller;
- :mod:`.heap`: the caches' objects frozen out of the collector's scans.
"""
