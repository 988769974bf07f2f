"""Writes: the one transport of both controllers' writes (:class:`Writer`), and the one
HTTP path of shared-svc to the API server (:func:`request`).

Raw JSON in and out (the cores speak dicts). Every write of a controller passes its
Writer: one token bucket each (the Services controller's ``writes_per_second``, the
upgrade controller's ``upgrade_writes_per_second``), so a bug or a fight can never turn
into a flood of requests, and one count of what was written. The Services controller
writes server-side applies, guarded JSON patches and preconditioned deletes; the upgrade
controller its node patches, evictions and pod deletes (``controllers/upgrade/io.py``).

Who writes is one rule for both (:func:`write_mode`; docs/operations.md "Dry-run"): the
leader writes, in dry-run it shows what it would write instead, a standby only plans.
Each controller asks it before it carries a plan out; the Writer asks it again before
every request and refuses one that is not the leader's to send (:class:`NotWriting`: the
Lease lost during a reconcile, or a write in dry-run), so no write leaves a standby or a
dry run whatever a controller does.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.k8s.managed_fields import FIELD_MANAGER as FIELD_MANAGER
from shared_svc.kube.resources import GVR, JSON, LEASES, SERVICE_MONITORS, SERVICES
from shared_svc.wait.ratelimit import BucketRateLimiter

APPLY = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"

log = logging.getLogger(__name__)

# kind -> resource. Only what shared-svc writes.
_WRITTEN: dict[str, GVR] = {
    "Service": SERVICES,
    "ServiceMonitor": SERVICE_MONITORS,
    "Lease": LEASES,
}


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    """The collection of ``kind`` in ``namespace``, or the object ``name`` in it."""
    gvr = _WRITTEN[kind]
    return gvr.item(name, namespace) if name else gvr.collection(namespace)


async def request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: Any = None,
    content_type: str = JSON,
    query: list[tuple[str, str]] | None = None,
    timeout: float | aiohttp.ClientTimeout = 30.0,
    accept: str = JSON,
) -> Any:
    """The one HTTP path of shared-svc to the API server: one request, its response
    unread (the caller reads and releases it: a watch streams it); a non-2xx answer
    raises ApiException with its body and headers (``Retry-After``).

    ``accept``: the answer's media type, e.g. ``resources.METADATA`` when only the
    answer's metadata is read (the API server encodes, and this parses, much less)."""
    headers = {"Accept": accept}
    if body is not None:
        headers["Content-Type"] = content_type  # the REST layer serializes the body as JSON
    resp = await api.call_api(
        path,
        method,
        query_params=query or [],
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=timeout,
    )
    if not 200 <= resp.status <= 299:
        try:
            raw = await resp.read()
        finally:
            resp.release()
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = raw.decode(errors="replace")
        exc.headers = resp.headers
        raise exc
    return resp


async def raw_request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: Any = None,
    content_type: str = JSON,
    query: list[tuple[str, str]] | None = None,
    timeout: float = 30.0,
    accept: str = JSON,
    fast: Callable[[bytes], Any] | None = None,
) -> Any:
    """One :func:`request`, read; returns parsed JSON; raises ApiException on a non-2xx
    answer. ``fast``: a reader of the answer that gives what ``json.loads`` gives, less
    fields nobody reads, or None to leave it to ``json.loads`` (``kube.decode.Decoder``)."""
    resp = await request(
        api,
        method,
        path,
        body=body,
        content_type=content_type,
        query=query,
        timeout=timeout,
        accept=accept,
    )
    try:
        raw = await resp.read()
    finally:
        resp.release()
    if not raw:
        return None
    read = fast(raw) if fast is not None else None
    return json.loads(raw) if read is None else read


def body_text(exc: BaseException) -> str:
    """The body of an API error as text (empty when there is none)."""
    body = getattr(exc, "body", None)
    if not body:
        return ""
    return body.decode(errors="replace") if isinstance(body, bytes) else str(body)


def status_of(exc: BaseException) -> dict[str, Any]:
    """The ``Status`` object an API error carries, parsed (empty when its body is not one)."""
    if not isinstance(exc, ApiException):
        return {}
    try:
        status = json.loads(body_text(exc) or "null")
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def describe_error(exc: BaseException) -> str:
    """One stable line for an API error (the same trouble reads the same on every retry)."""
    if isinstance(exc, ApiException):
        status = status_of(exc)
        message = str(status.get("message") or "") if status else body_text(exc)
        return f"{exc.status} {exc.reason or ''}: {message}".strip(" :")[:300]
    if isinstance(exc, TimeoutError):
        return "TimeoutError: no answer in time"
    return f"{type(exc).__name__}: {exc}"[:300]


def retry_after(exc: ApiException, default: float = 1.0) -> float:
    """Seconds the server asked us to wait (Retry-After), else ``default``."""
    headers: Any = exc.headers or {}
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else default
    except ValueError:
        return default


def namespace_gone(exc: BaseException) -> bool:
    """Whether a write was refused because its namespace is gone or being deleted.

    The API server's NamespaceLifecycle admission answers 404 NotFound naming the namespace
    (a deleted namespace), or 403 Forbidden with cause NamespaceTerminating.
    """
    status = status_of(exc)
    details = status.get("details")
    if not isinstance(details, dict):
        return False
    if status.get("code") == 404:
        return details.get("kind") == "namespaces"
    causes = details.get("causes")
    return (
        status.get("code") == 403
        and isinstance(causes, list)
        and any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes)
    )


async def delete_with_preconditions(
    api: ApiClient,
    path: str,
    preconditions: dict[str, str],
    *,
    successor_is_gone: bool = False,
) -> bool:
    """DELETE ``path`` if its object still matches ``preconditions``; True when deleted,
    False when it is gone already (404: what the delete wanted). With
    ``successor_is_gone``, a 409 (an object of the same name but another uid: a
    successor, not ours) is gone too; else it is raised (``concurrent_change``: plan
    again)."""
    body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": dict(preconditions)}
    try:
        await raw_request(api, "DELETE", path, body=body)
    except ApiException as exc:
        if exc.status == 404 or (successor_is_gone and exc.status == 409):
            return False
        raise
    return True


def concurrent_change(exc: BaseException) -> bool:
    """Whether a write met a concurrent change of its object: 409 Conflict (a precondition
    or a JSON patch's test no longer holds), or 404 NotFound naming the object (someone
    else deleted it). The API's normal answer, not a failure: plan again on the fresh
    cache. A 404 without a Status naming an object (the API itself not served) or one
    naming the namespace (``namespace_gone``) is not one."""
    if not isinstance(exc, ApiException):
        return False
    if exc.status == 409:
        return True
    details = status_of(exc).get("details")
    return (
        exc.status == 404
        and isinstance(details, dict)
        and bool(details.get("name"))
        and details.get("kind") not in (None, "namespaces")
    )


WriteMode = Literal["write", "dry-run", "standby"]


def write_mode(*, leader: bool, dry_run: bool) -> WriteMode:
    """What a replica does with its plans' writes: a standby (not the leader) plans only,
    dry-run or not; the leader in dry-run shows them and sends none (Events included);
    else the leader writes."""
    if not leader:
        return "standby"
    return "dry-run" if dry_run else "write"


class NotWriting(RuntimeError):
    """A write refused by the Writer: this replica is not the one to send it now."""


class Writer:
    """A controller's writes: each is refused unless this replica writes now (``mode``:
    :func:`write_mode` of ``is_leader`` and ``dry_run``), waits for a token of its bucket
    (``rate`` per second, ``burst``; or ``bucket``, made by the caller), is counted by verb
    (``writes``), then sent (:func:`raw_request`)."""

    def __init__(
        self,
        api: ApiClient,
        *,
        rate: float = 10.0,
        burst: int = 100,
        bucket: BucketRateLimiter | None = None,
        dry_run: bool = False,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self._api = api
        self._bucket = bucket or BucketRateLimiter(rate, burst, clock=time.monotonic)
        self._dry_run = dry_run
        self._is_leader = is_leader
        self.writes: Counter[str] = Counter()  # verb -> count, for /status and tests

    def mode(self) -> WriteMode:
        return write_mode(leader=self._is_leader(), dry_run=self._dry_run)

    async def _admit(self, verb: str) -> None:
        """A write's turn: its token, then refused unless this replica writes now (the
        Lease may be lost while it waits for the token)."""
        await self._bucket.take()
        if (mode := self.mode()) != "write":
            raise NotWriting(f"{verb} refused: {mode} (not the leader's to send now)")
        self.writes[verb] += 1

    async def send(self, verb: str, method: str, path: str, **kw: Any) -> Any:
        """One write request (:func:`raw_request`'s keywords), after its token."""
        await self._admit(verb)
        return await raw_request(self._api, method, path, **kw)

    async def delete_at(
        self, path: str, preconditions: dict[str, str], *, successor_is_gone: bool = False
    ) -> bool:
        """One preconditioned delete (:func:`delete_with_preconditions`), after its token."""
        await self._admit("delete")
        return await delete_with_preconditions(
            self._api, path, preconditions, successor_is_gone=successor_is_gone
        )

    async def apply(self, obj: dict[str, Any]) -> Any:
        meta = obj["metadata"]
        return await self.send(
            "apply",
            "PATCH",
            object_path(obj["kind"], meta["namespace"], meta["name"]),
            body=obj,
            content_type=APPLY,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
        )

    async def json_patch(
        self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> Any:
        return await self.send(
            "patch",
            "PATCH",
            object_path(kind, namespace, name),
            body=ops,
            content_type=JSON_PATCH,
            query=[("fieldManager", FIELD_MANAGER)],
        )

    async def delete(
        self, kind: str, namespace: str, name: str, preconditions: dict[str, str]
    ) -> None:
        await self.delete_at(object_path(kind, namespace, name), preconditions)
