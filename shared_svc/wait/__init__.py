"""Waiting, below ``kube/`` and ``runtime/`` (apimachinery's ``util/wait``, which
client-go's reflector and workqueue both import): imports nothing of ``shared_svc``.

- :mod:`.ratelimit`: the one family of retry delays (per-item exponential failure
  limiter, overall token bucket): the controllers' retries, the caches' reconnects, the
  writes' pacing;
- :mod:`.loop`: :func:`~.loop.repeat`, the one loop of every long-running part;
- :mod:`.runnable`: the :class:`~.runnable.Runnable` protocol of every long-running part
  (the Manager's, in ``runtime/``), with its default answers, for ``kube/`` and above.
"""
