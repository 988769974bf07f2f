"""The one nesting limit of an object shared-svc reads from outside: a manifest of
``plan -f`` (``manifests``) and an object the API server sends a cache (``kube.untrusted``).
"""

from __future__ import annotations

MAX_DEPTH = 100
"""Nesting levels of mappings and sequences kept in one object.

Kubernetes objects nest about 15 levels deep (real ones stay below 20); CRDs with
preserved unknown fields accept any depth. Python's parser and every recursive function
after it (copies, comparisons, digests) fail near 1,000, so a hostile 1,200-level field
would otherwise stop a reader."""

TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"
"""How a value past :data:`MAX_DEPTH` is named, in refusals and in the cache's marker."""
