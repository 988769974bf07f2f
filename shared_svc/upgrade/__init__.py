"""Free GPU consumers during in-place driver upgrades, and restore them.

The contract is the upgrade-release design document (not part of this repository);
``docs/upgrade.md`` describes what this package does.
Everything here except the shell (``controller.py``, ``io.py`` and ``metrics.py``) is
pure: plain Kubernetes objects (dicts, camelCase, as the API server returns them) and
``now`` in, a ``NodePlan`` out (tests/test_layers.py). The only code that talks to the
API server is ``shared_svc.controllers.upgrade.io``, through the generic ``shared_svc.kube``.
"""
