"""Identity of report occurrences: a digest of the data that names one."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_digest(value: Any) -> str:
    """First 16 hex digits of sha256 over canonical JSON: the same data, the same digest."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
