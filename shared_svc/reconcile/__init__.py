"""The pure reconcile core of the shared DCGM Services (contract sections 1-7, 9).

Entry point: :func:`shared_svc.reconcile.planner.plan`. See docs/reconcile.md for the
map from each contract rule to the function that implements it.
"""
