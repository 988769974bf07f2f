"""The Services controller's shell: what it reads (``caches``), its reconcile
(``reconciler``), how it carries a plan out (``executor``), what it says about each
reconcile (``outcomes``, ``status``, ``metrics``) and ServiceMonitor discovery."""
