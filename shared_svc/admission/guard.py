"""Which admission guard is active, for ``/status``, and the Warning when none is while
gpu-operator writes our objects.

shared-svc never writes admission configurations (the chart installs them); it lists
them (ClusterRole: ``list`` on mutatingadmissionpolicybindings,
mutatingwebhookconfigurations, validatingwebhookconfigurations) by the label
``nvidia.com/shared-svc.guard=<namespace>`` every ``discovery_seconds``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.admission.probe import probe, probe_guards, webhooks_of
from shared_svc.admission.rules import GUARD_LABEL, operator_username, operator_writes
from shared_svc.admission.verdicts import (
    ANSWERED_WRONGLY,
    FAILING,
    FAILS_OPEN,
    GUARDS,
    NOT_PROBED,
    Verdict,
    worst,
)
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.kube.recorder import EventPublisher
from shared_svc.kube.resources import (
    GVR,
    MUTATING_POLICY_BINDINGS,
    MUTATING_WEBHOOKS,
    VALIDATING_WEBHOOKS,
)
from shared_svc.kube.writer import raw_request
from shared_svc.runtime.manager import Manager, Periodic, Runnable
from shared_svc.wait.loop import repeat

if TYPE_CHECKING:
    from shared_svc.admission.server import NeededBy
    from shared_svc.http import HttpServer

log = logging.getLogger(__name__)

KINDS = {
    "policy": MUTATING_POLICY_BINDINGS,
    "webhook": MUTATING_WEBHOOKS,
    "delete": VALIDATING_WEBHOOKS,
}
MISSING_REASON = "AdmissionGuardMissing"
MISSING_SCOPE = "admission-guard/missing"  # the publisher's scope of its Warning
NOT_SERVED_REASON = "AdmissionGuardNotServed"
NOT_SERVED_SCOPE = "admission-guard/not-served"
# The guard probe through the API server (admission.verdicts): a Warning per guard failing.
FAILS_OPEN_REASONS = {
    FAILS_OPEN: "AdmissionGuardFailsOpen",
    ANSWERED_WRONGLY: "AdmissionGuardAnsweredWrongly",
}
FAILS_OPEN_SCOPE = "admission-guard/fails-open"
# Failing verdicts in a row before the Warning: one is a guard just installed that the API
# server has not loaded yet (its informers); two is within two probe periods.
FAILS_OPEN_CHECKS = 2
GUARD_KINDS = {  # the kind of the guard object each KINDS entry lists
    "policy": "MutatingAdmissionPolicyBinding",
    "webhook": "MutatingWebhookConfiguration",
    "delete": "ValidatingWebhookConfiguration",
}


def guard_mode(found: Mapping[str, Sequence[str] | None]) -> str:
    """``policy``, ``webhook`` or ``none`` from the names found per kind (None: the list
    failed, so ``unknown`` unless another kind already proves a guard)."""
    if found.get("policy"):
        return "policy"
    if found.get("webhook"):
        return "webhook"
    if any(found.get(k) is None for k in ("policy", "webhook")):
        return "unknown"
    return "none"


async def list_guard(api: ApiClient, namespace: str, gvr: GVR) -> list[dict[str, Any]]:
    """The guard objects of one kind for ``namespace`` (by GUARD_LABEL), by name; [] when
    the kind is not served (MutatingAdmissionPolicy before 1.36). Raises on other errors."""
    try:
        res = await raw_request(
            api,
            "GET",
            gvr.collection(),
            query=[("labelSelector", f"{GUARD_LABEL}={namespace}")],
            timeout=10.0,
        )
    except ApiException as exc:
        if exc.status == 404:
            return []
        raise
    return sorted(res.get("items") or [], key=lambda i: str(i["metadata"]["name"]))


async def probe_listed(
    api: ApiClient,
    namespace: str,
    listed: Mapping[str, Sequence[Mapping[str, Any]] | None],
    services: Sequence[Mapping[str, Any]],
    needed_by: NeededBy | None = None,
) -> list[Verdict]:
    """The guard probe through the API server (``probe.probe_guards``) of the guards
    ``listed`` (per kind of :data:`KINDS`): the monitor's, every check, and ``shared-svc
    admission probe``'s, once."""
    found = {
        k: None if v is None else [i["metadata"]["name"] for i in v] for k, v in listed.items()
    }
    return await probe_guards(
        api,
        namespace,
        services=services,
        delete_webhooks=[h.name for h in webhooks_of(listed.get("delete") or ())],
        update_guard=guard_mode(found) in ("policy", "webhook"),
        needed_by=needed_by,
    )


def guard_warning(kind: str, name: str, reason: str, note: str, *, key: str) -> Report:
    """A Warning about one guard object (``kind``: a key of :data:`KINDS`); cluster-scoped,
    so the Event is in ``default``."""
    gvr = KINDS[kind]
    return Report(
        type="Warning",
        reason=reason,
        action="Reconcile",
        regarding=ObjectRef(
            api_version=f"{gvr.group}/{gvr.version}", kind=GUARD_KINDS[kind], name=name
        ),
        note=note,
        key=key,
    )


class GuardMonitor(Runnable):
    def __init__(
        self,
        api: ApiClient,
        *,
        namespace: str,
        field_manager: str,
        recorder: EventPublisher,
        objects: Callable[[], Sequence[Mapping[str, Any]] | None],
        is_leader: Callable[[], bool],
        interval: float,
        webhook_serving: Callable[[], bool],
        needed_by: Callable[[], NeededBy | None] = lambda: None,
        on_checked: Callable[[GuardMonitor], None] | None = None,
    ) -> None:
        self._api = api
        self._ns = namespace
        self._manager = field_manager
        self._recorder = recorder
        self._objects = objects
        self._is_leader = is_leader
        self._interval = interval
        self._webhook_serving = webhook_serving
        self._needed_by = needed_by
        self._on_checked = on_checked  # the metrics (shared_svc.service_metrics.publish_guard)
        self.found: dict[str, list[str] | None] = {}
        self.errors: dict[str, str] = {}
        self.checked_at: str | None = None
        self.checks = 0  # checks completed (each lists, probes and reports once)
        self.warned: bool = False  # the Warning of the current episode is written
        self.webhooks: list[dict[str, Any]] = []  # each configured webhook: served or not
        self.writers: list[str] = []  # our objects gpu-operator writes with no guard active
        # the guard probe through the API server, per guard (delete, update)
        self.verdicts: dict[str, Verdict] = {
            g: Verdict(g, NOT_PROBED, "not probed yet") for g in GUARDS
        }
        self._failing: dict[str, int] = dict.fromkeys(GUARDS, 0)  # failing checks in a row

    async def _list(self, gvr: GVR) -> list[dict[str, Any]] | None:
        """Our guard objects of one kind; [] when the kind is not served; None (and the
        error kept) when the list fails."""
        try:
            items = await list_guard(self._api, self._ns, gvr)
        except ApiException as exc:
            self.errors[gvr.plural] = f"{exc.status} {exc.reason}"
            return None
        except Exception as exc:  # the API server is away: unknown, try again later
            self.errors[gvr.plural] = f"{type(exc).__name__}: {exc}"[:200]
            return None
        self.errors.pop(gvr.plural, None)
        return items

    async def check(self) -> None:
        listed = {kind: await self._list(gvr) for kind, gvr in KINDS.items()}
        self.found = {
            kind: None if items is None else [i["metadata"]["name"] for i in items]
            for kind, items in listed.items()
        }
        self.checked_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        await self._warn_if_unguarded()
        configurations = {k: v for k, v in listed.items() if k in ("webhook", "delete")}
        if all(v is not None for v in configurations.values()):
            await self._probe(configurations)
        await self._probe_through_api(listed)
        self.checks += 1
        if self._on_checked is not None:
            self._on_checked(self)

    async def _probe(self, configurations: Mapping[str, list[dict[str, Any]] | None]) -> None:
        """Asks each configured webhook with a ``url`` whether it is served (probe.py);
        a Warning per webhook that is not, once per episode (by the leader)."""
        self.webhooks = []
        reports = []
        for kind, items in configurations.items():
            for hook in webhooks_of(items or ()):
                error = None if hook.url is None else await probe(hook, self._ns)
                served = None if hook.url is None else error is None
                self.webhooks.append(
                    {
                        "configuration": hook.configuration,
                        "webhook": hook.name,
                        "url": hook.url,
                        "served": served,
                        "error": error,
                    }
                )
                if served is False:
                    reports.append(
                        self._not_served_report(kind, hook.configuration, hook.name, error)
                    )
        if self._is_leader():
            await self._recorder.level(NOT_SERVED_SCOPE, reports)

    async def _probe_through_api(self, listed: Mapping[str, list[dict[str, Any]] | None]) -> None:
        """The leader asks the API server whether it applies the guard (probe_guards: dry
        runs that change nothing); a Warning per guard failing open or answering wrongly
        in FAILS_OPEN_CHECKS checks in a row, once per episode. A standby, or a guard
        whose listing failed, is not probed."""
        if not self._is_leader():
            self.verdicts = {g: Verdict(g, NOT_PROBED, "not the leader") for g in GUARDS}
            self._failing = dict.fromkeys(GUARDS, 0)
            return
        if listed.get("delete") is None or self.mode == "unknown":
            return  # nothing known: the last verdicts stand
        objects = self._objects()
        if objects is None:
            return  # the caches are not synced yet
        verdicts = await probe_listed(self._api, self._ns, listed, objects, self._needed_by())
        self.verdicts = {v.guard: v for v in verdicts}
        for v in verdicts:
            self._failing[v.guard] = self._failing[v.guard] + 1 if v.reason in FAILING else 0
        reports = [
            self._fails_open_report(v, listed)
            for v in verdicts
            if self._failing[v.guard] >= FAILS_OPEN_CHECKS
        ]
        await self._recorder.level(FAILS_OPEN_SCOPE, reports)

    def _fails_open_report(
        self, verdict: Verdict, listed: Mapping[str, list[dict[str, Any]] | None]
    ) -> Report:
        """On the guard object the API server failed to apply: the delete guard's
        ValidatingWebhookConfiguration, the update guard's MutatingWebhookConfiguration or
        MutatingAdmissionPolicyBinding (cluster-scoped: the Event is in ``default``)."""
        kind = (
            "delete"
            if verdict.guard == "delete"
            else ("policy" if self.mode == "policy" else "webhook")
        )
        name = str(((listed.get(kind) or [{}])[0].get("metadata") or {}).get("name", ""))
        reason = FAILS_OPEN_REASONS[verdict.reason]
        what = (
            "gpu-operator's deletes of Services a CR needs go through"
            if verdict.guard == "delete"
            else "gpu-operator's whole-object updates undo shared-svc's (ConflictingWriter follows)"
        )
        return guard_warning(
            kind,
            name,
            reason,
            (
                f"the API server does not apply the admission guard's {verdict.guard} guard "
                f"({verdict.reason}: {verdict.detail}): {what}. Probed with a dry run of "
                f"Service {verdict.target}. Runbook: docs/operations.md, "
                "SharedSvcAdmissionGuardFailsOpen."
            )[:1000],
            key=f"{reason}/{self._ns}/{verdict.guard}",
        )

    @property
    def fails_open(self) -> bool | None:
        """True when a guard fails open or answers wrongly by the last probe, False when
        each probed guard was served, None when none was probed."""
        reason = worst(self.verdicts.values())
        if reason in FAILING:
            return True
        return False if reason == "served" else None

    def _not_served_report(
        self, kind: str, configuration: str, webhook: str, error: str | None
    ) -> Report:
        return guard_warning(
            kind,
            configuration,
            NOT_SERVED_REASON,
            (
                f"the admission guard's webhook {webhook} is configured but not served ({error}); "
                "with failurePolicy Ignore the API server lets gpu-operator's writes through "
                "unguarded. Serve the webhook at that URL (webhook_port equal to the URL's port, "
                "the certificate from the chart's Secret; docs/install.md) or unset "
                "admission.webhook.url."
            ),
            key=f"{NOT_SERVED_REASON}/{self._ns}/{configuration}/{webhook}",
        )

    @property
    def served(self) -> bool | None:
        """False when a configured webhook answers no AdmissionReview; True when every
        probed one does; None when none was probed."""
        probed = [w["served"] for w in self.webhooks if w["served"] is not None]
        return all(probed) if probed else None

    @property
    def mode(self) -> str:
        return guard_mode(self.found) if self.checked_at else "unknown"

    async def _warn_if_unguarded(self) -> None:
        """One Warning per episode of gpu-operator writing our objects with no guard active
        (the publisher's level scope: a guard, or no such writes, ends the episode)."""
        objects = self._objects()
        if self.mode == "unknown" or (objects is None and self.mode == "none"):
            return  # nothing known: the episode goes on as it was
        writers = operator_writes(objects or (), self._manager) if self.mode == "none" else []
        self.writers = writers
        if writers and not self._is_leader():
            return
        report = self._missing_report(objects or (), writers) if writers else None
        await self._recorder.level(MISSING_SCOPE, [report] if report else ())
        self.warned = bool(self._recorder.sent(MISSING_SCOPE))

    def _missing_report(self, objects: Sequence[Mapping[str, Any]], writers: list[str]) -> Report:
        first = next(o for o in objects if f"{o.get('kind')}/{o['metadata']['name']}" == writers[0])
        meta = first["metadata"]
        return Report(
            type="Warning",
            reason=MISSING_REASON,
            action="Reconcile",
            regarding=ObjectRef(
                api_version=first.get("apiVersion", "v1"),
                kind=first.get("kind", "Service"),
                name=meta["name"],
                namespace=meta.get("namespace"),
                uid=meta.get("uid"),
            ),
            note=(
                f"field manager {self._manager} writes {', '.join(writers)} and no "
                "admission guard is active: its whole-object updates undo shared-svc's "
                "(ConflictingWriter follows) and its deletes remove Services other CRs "
                "need. Install the chart's admission guard (docs/install.md)."
            ),
            key=f"{MISSING_REASON}/{self._ns}",
        )

    # --- the Runnable (shared_svc.wait.runnable; its defaults: ready, alive, deaf to
    # leadership): lists as a standby too; only the leader sends its Warnings ---
    name = "admission-guard"

    async def run(self, stop: asyncio.Event) -> None:
        await repeat(stop, self._check_logged, lambda: self._interval, name=self.name)

    async def _check_logged(self) -> None:
        try:
            await self.check()
        except Exception as exc:  # never ends the service: /status shows the error
            log.warning("admission guard check failed", extra={"error": str(exc)})

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "deleteGuard": bool(self.found.get("delete")),
            "objects": {k: v for k, v in self.found.items() if v},
            "webhookServing": self._webhook_serving(),
            "served": self.served,
            "webhooks": list(self.webhooks),
            "failsOpen": self.fails_open,
            "probe": {g: v.as_status() for g, v in self.verdicts.items()},
            "checkedAt": self.checked_at,
            "errors": dict(self.errors),
        }


class AdmissionGuard:
    """What service.py runs for the guard: the webhook server (when a certificate is
    configured) and the monitor. What they read of the Services controller is two
    functions: ``objects``, our Services and ServiceMonitors as cached (None until the
    caches synced: the monitor's ``AdmissionGuardMissing``), and ``needed_by``, who needs
    each managed object by the last plan (None before it: the webhook's decisions)."""

    def __init__(
        self,
        api: ApiClient,
        config: Any,
        *,
        recorder: EventPublisher,
        objects: Callable[[], Sequence[Mapping[str, Any]] | None],
        needed_by: Callable[[], NeededBy | None],
        is_leader: Callable[[], bool],
        on_checked: Callable[[GuardMonitor], None] | None = None,
        on_answered: Callable[[str, int, float], None] | None = None,
        on_certificate: Callable[[float | None], None] | None = None,
    ) -> None:
        """``on_answered`` and ``on_certificate``: the webhook server's report of each
        request and each certificate it loads (``server.make_webhook_app``,
        ``server.CertReloader``)."""
        self._config = config
        self._needed_by = needed_by
        self._on_answered = on_answered
        self._on_certificate = on_certificate
        self._server: HttpServer | None = None  # the webhook server, with a certificate
        self._stop = asyncio.Event()  # start()/stop() only
        self._manager: Manager | None = None
        self._task: asyncio.Future[list[BaseException]] | None = None
        self.certs: Any = None  # server.CertReloader while the webhook serves
        self.monitor = GuardMonitor(
            api,
            namespace=config.namespace,
            field_manager=config.operator_field_manager,
            recorder=recorder,
            objects=objects,
            is_leader=is_leader,
            interval=config.discovery_seconds,
            webhook_serving=lambda: self.webhook_port is not None,
            needed_by=needed_by,
            on_checked=on_checked,
        )

    def runnables(self) -> list[Runnable]:
        """The webhook server (when a certificate is configured), its certificate reload,
        and the monitor, in start order (Runnables of the service's Manager)."""
        cfg = self._config
        out: list[Runnable] = []
        if cfg.webhook_cert_file and cfg.webhook_key_file:
            from shared_svc.admission.server import CertReloader, make_webhook_app
            from shared_svc.http import HttpServer

            self.certs = certs = CertReloader(
                cfg.webhook_cert_file, cfg.webhook_key_file, on_loaded=self._on_certificate
            )
            app = make_webhook_app(
                namespace=cfg.namespace,
                operator_users=[operator_username(cfg.namespace, cfg.operator_service_account)],
                needed_by=self._needed_by,
                on_answered=self._on_answered,
            )
            # The same server settings as the probes': a malformed request is one INFO line,
            # a client that never completes a request is closed.
            self._server = HttpServer(
                "admission-webhook",
                app,
                cfg.bind_address,
                cfg.webhook_port,
                ssl_context=certs.context,
            )
            out.append(self._server)
            out.append(
                Periodic(
                    "webhook-certificate",
                    certs.reload_if_changed,
                    lambda: self._config.discovery_seconds,
                )
            )
        out.append(self.monitor)
        return out

    @property
    def webhook_port(self) -> int | None:
        return self._server.port if self._server is not None else None

    async def start(self) -> None:
        """Runs :meth:`runnables` on a Manager of its own (without the service's)."""
        self._manager = Manager(self.runnables(), lambda: False)
        self._task = await self._manager.start(self._stop)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        out = self.monitor.status()
        if self.certs is not None:
            out["certificate"] = {"reloads": self.certs.reloads, "lastError": self.certs.last_error}
        return out
