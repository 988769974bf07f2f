"""Free GPU consumers during in-place driver upgrades, and restore them.

The contract is the upgrade-release design document (not part of this repository);
``docs/upgrade.md`` describes what this package does.
Everything here is pure: plain Kubernetes objects (dicts, camelCase, as the API server
returns them) and ``now`` in, a ``NodePlan`` out (``planner.plan_node``; the plan's types
in ``node_plan``, its pods in ``pods``, what status reports in ``node_status``;
tests/test_layers.py). Its shell is ``shared_svc.controllers.upgrade``, whose ``io`` is
the only code that talks to the API server, through the generic ``shared_svc.kube``.
"""
