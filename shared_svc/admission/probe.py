"""Whether the configured webhook guard is being served (issue 19 item 5).

With ``admission.webhook.url`` set, the chart's Deployment no longer serves the webhook:
whatever serves the URL must. With ``failurePolicy: Ignore`` a URL that reaches no
webhook server leaves the guard off without an error anywhere, so the guard monitor asks
each webhook with a ``url`` itself, as the API server would: a POST of a harmless
AdmissionReview (a DELETE by no one in particular, which every guard allows), trusting the
webhook's ``caBundle``. A webhook behind a ``service`` is reached through the API server's
service network and is not probed here (``served: null``; ``webhookServing`` says whether
this replica serves).
"""

from __future__ import annotations

import base64
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

PROBE_SECONDS = 5.0
PROBE_USER = "system:serviceaccount:shared-svc-guard-probe:probe"


@dataclass(frozen=True)
class Webhook:
    """One webhook of a guard configuration, as the API server would call it."""

    configuration: str
    name: str
    url: str | None  # None: behind a service (not probed)
    ca_bundle: str | None  # base64 PEM


def webhooks_of(configurations: Iterable[Mapping[str, Any]]) -> list[Webhook]:
    out = []
    for conf in configurations:
        for hook in conf.get("webhooks") or []:
            client = hook.get("clientConfig") or {}
            out.append(
                Webhook(
                    configuration=str((conf.get("metadata") or {}).get("name", "")),
                    name=str(hook.get("name", "")),
                    url=client.get("url"),
                    ca_bundle=client.get("caBundle"),
                )
            )
    return out


def probe_review(namespace: str) -> dict[str, Any]:
    """An AdmissionReview every guard allows: a DELETE of a Service no CR needs, by a user
    that is not gpu-operator (nothing is deleted: the review is only answered)."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "shared-svc-guard-probe",
            "kind": {"group": "", "version": "v1", "kind": "Service"},
            "resource": {"group": "", "version": "v1", "resource": "services"},
            "name": "shared-svc-guard-probe",
            "namespace": namespace,
            "operation": "DELETE",
            "userInfo": {"username": PROBE_USER},
            "dryRun": True,
        },
    }


def _context(ca_bundle: str | None) -> ssl.SSLContext:
    if not ca_bundle:
        return ssl.create_default_context()
    return ssl.create_default_context(cadata=base64.b64decode(ca_bundle).decode())


async def probe(hook: Webhook, namespace: str) -> str | None:
    """None when the webhook's URL answers an AdmissionReview; else why not, in one line."""
    assert hook.url is not None
    try:
        context = _context(hook.ca_bundle)
        timeout = aiohttp.ClientTimeout(total=PROBE_SECONDS)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(hook.url, json=probe_review(namespace), ssl=context) as resp,
        ):
            if resp.status != 200:
                return f"{hook.url} answered HTTP {resp.status}"
            answer = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, ssl.SSLError, ValueError, TimeoutError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{hook.url}: {type(exc).__name__}: {text}"[:200].rstrip(": ")
    if not isinstance(answer, dict) or answer.get("kind") != "AdmissionReview":
        return f"{hook.url} answered no AdmissionReview"
    return None
