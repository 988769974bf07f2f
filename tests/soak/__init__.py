"""The soak (issue 44): a seeded, reproducible life of a cluster, with faults, on the real
parties, checked after every step against a model of what the contracts promise.

- :mod:`tests.soak.model`: the model (pure): the CRs as the steps leave them, which
  Service each needs (docs/reconcile.md, the contract's section 2), and the choice of the
  next step from the seed and the model alone, so a seed replays the same history.
- :mod:`tests.soak.world`: the real parties: the test control plane with
  kube-controller-manager, the real gpu-operator, the chart's admission guard (the policy
  and the delete webhook, reached through a proxy that fails over between the replicas as
  the chart's webhook Service does), and two ``shared-svc run`` processes with the
  shipped defaults and the chart's RBAC, talking to the API server through a proxy (watch
  cuts); the faults.
- :mod:`tests.soak.upgrades`: the driver-upgrade side: the real upgrade state machine of
  gpu-operator v26.7.0's libs, its stand-ins, the GPU consumers, and each step's verdicts.
- :mod:`tests.soak.timeline`: the invariants about time, judged on the API server's own
  order of events: no consumer asked to go outside the freeing states, the hold.
- :mod:`tests.soak.runner`: the loop, the invariants, the history, the dump on a violation.

``make soak STEPS=... SEED=... BUDGET=...`` runs it long (``python -m tests.soak``);
tests/test_soak.py runs a bounded life in ``make test`` and proves that a planted bug is
caught.
"""
