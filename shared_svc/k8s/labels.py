"""Label keys and values, and object names, as the API server validates them
(``IsQualifiedName``, ``IsValidLabelValue``, ``IsDNS1123Subdomain``, ``IsDNS1123Label``)."""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
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


def is_object_name(name: str, *, label: bool = False) -> bool:
    """A DNS-1123 subdomain of at most 253 characters (most objects: a DaemonSet, a Secret,
    a webhook configuration; also a host name), or with ``label`` a DNS-1123 label of at
    most 63 (a namespace, a Service): lower-case alphanumerics and ``-`` (and ``.`` between
    labels), starting and ending with an alphanumeric. The whole string must match."""
    if label:
        return len(name) <= 63 and bool(_DNS_LABEL.fullmatch(name))
    return len(name) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(name))
