"""Whether the configured webhook guard is being served (issue 19 item 5), and whether the
API server applies it (issue 43: ``probe_guards``, the rules in ``admission.verdicts``).

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
import json
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.admission.verdicts import (
    NOT_PROBED,
    PROBE_FAILED,
    PROBE_FIELD_MANAGER,
    Verdict,
    delete_verdict,
    probe_target,
    update_patch,
    update_verdict,
)
from shared_svc.kube.resources import JSON, SERVICES
from shared_svc.kube.writer import JSON_PATCH, request, status_of

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


# --- the guard through the API server (issue 43; the rules: admission.verdicts) ---


async def _dry_run(
    api: ApiClient, method: str, path: str, body: Any, content_type: str, timeout: float
) -> tuple[int, Any, list[str]]:
    """One dry-run request: its HTTP status, its parsed body (the object, or the Status of
    a refusal) and its ``Warning`` headers."""
    query = [("dryRun", "All")]
    if method == "PATCH":
        query.append(("fieldManager", PROBE_FIELD_MANAGER))
    try:
        resp = await request(
            api, method, path, body=body, content_type=content_type, query=query, timeout=timeout
        )
    except ApiException as exc:
        headers: Any = exc.headers
        found = headers.getall("Warning", []) if hasattr(headers, "getall") else []
        return int(exc.status or 0), status_of(exc), list(found)
    try:
        raw = await resp.read()
        warnings = list(resp.headers.getall("Warning", []))
    finally:
        resp.release()
    return int(resp.status), json.loads(raw) if raw else {}, warnings


async def probe_delete(
    api: ApiClient, namespace: str, target: Mapping[str, Any], webhooks: Iterable[str],
    timeout: float = 40.0,
) -> Verdict:  # fmt: skip
    """A dry-run DELETE of ``target`` by this client's identity, judged."""
    name = str(target["metadata"]["name"])
    # In the body: with a DeleteOptions body the API server reads no query parameter, so
    # a dryRun given only as ?dryRun=All would delete the object.
    body = {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "dryRun": ["All"],
        "preconditions": {"uid": target["metadata"].get("uid")},
    }
    try:
        status, answer, warnings = await _dry_run(
            api, "DELETE", SERVICES.item(name, namespace), body, JSON, timeout
        )
    except Exception as exc:  # the API server away, a timeout: nothing to judge
        return Verdict("delete", PROBE_FAILED, _one_line(exc), name)
    message = str(answer.get("message", "")) if isinstance(answer, Mapping) else ""
    return delete_verdict(status, message, warnings, webhooks=webhooks, target=name)


async def probe_update(
    api: ApiClient, namespace: str, target: Mapping[str, Any], timeout: float = 40.0
) -> Verdict:
    """A dry-run patch of ``target`` shaped like gpu-operator's whole-object write, judged."""
    name = str(target["metadata"]["name"])
    try:
        status, answer, _ = await _dry_run(
            api, "PATCH", SERVICES.item(name, namespace), update_patch(target), JSON_PATCH, timeout
        )
    except Exception as exc:
        return Verdict("update", PROBE_FAILED, _one_line(exc), name)
    if not 200 <= status <= 299 or not isinstance(answer, Mapping):
        message = answer.get("message", "") if isinstance(answer, Mapping) else ""
        return Verdict("update", PROBE_FAILED, f"{status}: {message}"[:300], name)
    return update_verdict(target, answer, target=name)


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200].rstrip(": ")


async def probe_guards(
    api: ApiClient,
    namespace: str,
    *,
    services: Iterable[Mapping[str, Any]],
    delete_webhooks: Sequence[str],
    update_guard: bool,
    needed_by: Mapping[tuple[str, str], Sequence[str]] | None = None,
) -> list[Verdict]:
    """One probe of the guards there are: the delete guard (``delete_webhooks``: its
    webhook names; none: not probed) and the update guard (the policy or the mutating
    webhook) through the API server, about one Service a CR needs (``probe_target``)."""
    target = probe_target(services, needed_by)
    out = []
    for guard, present in (("delete", bool(delete_webhooks)), ("update", update_guard)):
        if not present:
            out.append(Verdict(guard, NOT_PROBED, f"no {guard} guard configured"))
        elif target is None:
            out.append(Verdict(guard, NOT_PROBED, "no Service a CR needs: nothing to guard"))
        elif guard == "delete":
            out.append(await probe_delete(api, namespace, target, delete_webhooks))
        else:
            out.append(await probe_update(api, namespace, target))
    return out
