"""Free GPU consumers during in-place driver upgrades, and restore them.

The contract is ``/work/shared/design/upgrade-release.md`` (see ``docs/upgrade.md``).
Everything here except ``controller.py`` and ``metrics.py`` is pure: plain Kubernetes
objects (dicts, camelCase, as the API server returns them) and ``now`` in, a
``NodePlan`` out. The only code that talks to the API server is
``shared_svc.kube.upgrade_io``.
"""
