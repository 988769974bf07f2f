"""Label keys and values as the API server validates them (``IsQualifiedName``,
``IsValidLabelValue``)."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def is_label_key(key: str) -> bool:
    """``[prefix/]name``: a DNS subdomain of at most 253 characters, and a name of at most
    63 alphanumerics, ``-``, ``_`` and ``.``, starting and ending with an alphanumeric."""
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return bool(_NAME.fullmatch(name))


def is_label_value(value: str) -> bool:
    """Empty, or a name of at most 63 characters (as a label key's name part)."""
    return bool(_VALUE.fullmatch(value))
