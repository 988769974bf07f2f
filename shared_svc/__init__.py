"""shared-svc: shared DCGM Services for gpu-operator, and GPU-consumer release during driver upgrades."""

__version__ = "0.1.0"
