"""The two controllers' shells, side by side and shaped alike (docs/architecture.md):
``services/`` runs the Services contract (``shared_svc.reconcile``), ``upgrade/`` the
driver-upgrade contract (``shared_svc.upgrade``)."""
