"""The driver-upgrade controller's shell: what it reads (``caches``), its reconcile of
one node (``reconciler``), its API calls (``io``), how it carries a node's plan out
(``executor``), what it says (``announce``, ``status``, ``metrics``) and the review of
the upgrade flow's gate."""
