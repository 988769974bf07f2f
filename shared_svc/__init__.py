"""shared-svc: shared DCGM Services for gpu-operator, and GPU-consumer release during driver upgrades."""

__version__ = "0.1.0"

from shared_svc import lazy_imports as _lazy_imports

_lazy_imports.install()  # kubernetes_asyncio's names imported as used (lazy_imports.py)
