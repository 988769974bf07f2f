"""One small controller runtime under both controllers (client-go's workqueue and
controller-runtime's Manager, cut to what shared-svc needs), on ``shared_svc.wait`` (the
loop helper and the rate limiters, which ``kube/`` uses too).

- :mod:`.workqueue`: a de-duplicating work queue with in-flight tracking, delayed adds,
  rate-limited adds and a bounded drain on shutdown;
- :mod:`.runnable`: the runnable protocol (run, ready, alive, status, leader gating), the
  :class:`~.runnable.Controller` that runs workers over a queue, and the manager that
  runs the runnables;
- :mod:`.metrics`: controller-runtime's metric names, shared by every controller.
"""
