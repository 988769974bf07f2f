"""Kubernetes object helpers: pure, shared by both cores and the shell.

Metadata accessors (``objects``), label-key and value validation (``labels``), the one
label-selector parser and matcher (``selectors``), the Event vocabulary and note
truncation in bytes (``events``), the managedFields lookup (``managed_fields``) and the
DaemonSet projection both planners read (``projections``). Nothing here does I/O or reads
a clock, and nothing here imports any other part of ``shared_svc``
(tests/test_layers.py).
"""
