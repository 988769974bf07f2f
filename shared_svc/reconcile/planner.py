"""``plan(world, settings)``: the whole contract (sections 1-7, 9) as one pure function.

Each rule lives in its own module; this one only joins them in the order the rules
depend on each other: who counts and needs what, then selectors, then the shape of each
object, then the writes that bring the live objects there, in a coverage-safe order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shared_svc.k8s.events import ObjectRef, Report, note
from shared_svc.k8s.objects import (
    K8sObject,
    annotations_of,
    in_namespace,
    labels_of,
    meta,
    name_of,
    spec,
)
from shared_svc.reconcile.conflicts import Resolution, conflict_reports, cr_event_ref
from shared_svc.reconcile.diff import (
    Desired,
    action_for_desired,
    action_for_unneeded,
    going_away,
    order_actions,
)
from shared_svc.reconcile.digest import stable_digest
from shared_svc.reconcile.model import (
    Action,
    ManagedKind,
    ObjectStatus,
    Pending,
    Plan,
    Settings,
    SpecError,
    World,
)
from shared_svc.reconcile.monitoring import (
    ScrapeTarget,
    duplicate_scrape_targets,
    monitor_of,
    monitor_settings,
    scrape_value,
    service_monitor_body,
)
from shared_svc.reconcile.names import (
    EXPORTER,
    EXPORTER_DRA,
    MONITOR_LABEL,
    SCRAPE_ANNOTATION,
    SERVICE_API,
    SERVICE_MONITOR_API,
    SERVICE_MONITOR_NAMES,
    SERVICE_NAMES,
)
from shared_svc.reconcile.needs import Needs, ObjectKey, compute_needs, counting_crs
from shared_svc.reconcile.owners import adoptable, is_managed, kept_owner_refs, owner_refs_for
from shared_svc.reconcile.selection import (
    SelectorChoice,
    Workloads,
    choose_selector,
    index_workloads,
    selects_dra_pods,
)
from shared_svc.reconcile.shapes import exporter_settings, service_body
from shared_svc.reconcile.specs import CRSpec

MONITOR_KEYS: dict[str, ObjectKey] = {n: ("ServiceMonitor", n) for n in SERVICE_MONITOR_NAMES}


def live_objects(world: World, settings: Settings) -> dict[ObjectKey, K8sObject]:
    """The live objects that carry one of our names, in the operator namespace."""
    found: dict[ObjectKey, K8sObject] = {}
    for svc in world.services:
        if (
            isinstance(svc, dict)
            and in_namespace(svc, settings.namespace)
            and name_of(svc) in SERVICE_NAMES
        ):
            found[("Service", name_of(svc))] = svc
    if settings.service_monitor_served:
        for sm in world.service_monitors:
            if (
                isinstance(sm, dict)
                and in_namespace(sm, settings.namespace)
                and name_of(sm) in SERVICE_MONITOR_NAMES
            ):
                found[MONITOR_KEYS[name_of(sm)]] = sm
    return found


class _Planner:
    """Holds the intermediate results of one plan; every method is pure."""

    def __init__(self, world: World, settings: Settings) -> None:
        self.world = world
        self.settings = settings
        self.crs = counting_crs(world)
        self.live = live_objects(world, settings)
        self.needs: Needs = compute_needs(self.crs, self.live)
        self.workloads: Workloads = index_workloads(world, settings.namespace)
        self.resolutions: list[Resolution] = []
        self.reports: list[Report] = []
        self.pending: list[Pending] = []
        self.notes: list[str] = []
        self.waits: list[float] = []  # seconds until a waiting rule is due
        self.desired: dict[ObjectKey, Desired] = {}
        self.choices: dict[str, SelectorChoice] = {}
        # Our ServiceMonitors that a CR needs and that we keep (served or not yet): the
        # ones an exporter Service may name in MONITOR_LABEL.
        self.kept_monitors = frozenset(
            name for name, key in MONITOR_KEYS.items() if self.will_manage(key)
        )

    def will_manage(self, key: ObjectKey) -> bool:
        """Needed, and either absent, ours, or ours to adopt."""
        live = self.live.get(key)
        return bool(self.needs.needed_by(key)) and (
            live is None or is_managed(live) or adoptable(live, self.settings.adopt)
        )

    def spec_errors(self) -> list[SpecError]:
        errors = []
        for cr in self.crs:
            if cr.error is None:
                continue
            message = note(
                f"spec not understood: {cr.error}. Its ownership is kept and its settings are "
                "ignored until it is fixed"
            )
            errors.append(SpecError(cr.kind, cr.name, "InvalidSpec", message))
            self.reports.append(
                Report(
                    "Warning",
                    "InvalidSpec",
                    "Reconcile",
                    cr_event_ref(cr),
                    message,
                    key=f"InvalidSpec/{cr.label}/{stable_digest([cr.uid, cr.error])}",
                )
            )
        return errors

    def plan_services(self) -> None:
        ns = self.settings.namespace
        for name in SERVICE_NAMES:
            svc_key: ObjectKey = ("Service", name)
            if self.needs.needed_by(svc_key):
                live = self.live.get(svc_key)
                current = spec(live).get("selector") if live and self.will_manage(svc_key) else None
                self.choices[name] = choose_selector(
                    name, self.needs, self.workloads, self.settings, current
                )
        canonical = self.choices.get(EXPORTER)
        covers_dra = (
            canonical is not None
            and self.will_manage(("Service", EXPORTER))
            and selects_dra_pods(canonical, self.workloads)
        )
        for name, choice in self.choices.items():
            key: ObjectKey = ("Service", name)
            needing = self.needs.needed_by(key)
            if choice.pending is not None:
                self.pending.append(
                    Pending(f"Service/{name}", "SelectorMigrationPending", choice.pending)
                )
                self.reports.append(
                    self._service_report(
                        "Warning",
                        "SelectorMigrationPending",
                        name,
                        choice.pending,
                        "/".join(f"{k}={v}" for k, v in sorted(choice.selector.items())),
                    )
                )
            if name in (EXPORTER, EXPORTER_DRA):
                service_type, policy = exporter_settings(name, needing, self.live.get(key))
                self._collect(service_type, policy)
                scrape = scrape_value(name, covers_dra)
                body = service_body(
                    name,
                    ns,
                    choice.selector,
                    owner_refs_for(needing),
                    scrape=scrape,
                    monitor=monitor_of(name, scrape, self.kept_monitors),
                    service_type=service_type.value,
                    traffic_policy=policy.value,
                )
            else:
                body = service_body(name, ns, choice.selector, owner_refs_for(needing))
            self.desired[key] = Desired("Service", name, body)

    def plan_service_monitors(self) -> None:
        for name, key in MONITOR_KEYS.items():
            needing = self.needs.needed_by(key)
            if not needing:
                continue
            if not self.settings.service_monitor_served:
                who = ", ".join(cr.label for cr in needing)
                self.notes.append(
                    f"ServiceMonitor {name} skipped: {SERVICE_MONITOR_API} ServiceMonitor is not "
                    f"served by the cluster (needed by {who})"
                )
                continue
            settings = monitor_settings(name, needing, self.live.get(key))
            self._collect(*settings.resolutions)
            self.reports.extend(settings.reports)
            body = service_monitor_body(
                name, self.settings.namespace, settings, owner_refs_for(needing)
            )
            self.desired[key] = Desired("ServiceMonitor", name, body)

    def ours_selects(self) -> dict[str, str]:
        """Exporter Service -> the ServiceMonitor of ours that selects it after the plan."""
        out = {}
        for name in (EXPORTER, EXPORTER_DRA):
            key: ObjectKey = ("Service", name)
            if key not in self.desired or not self.will_manage(key):
                continue
            monitor = labels_of(self.desired[key].body).get(MONITOR_LABEL)
            if monitor in MONITOR_KEYS and MONITOR_KEYS[monitor] in self.desired:
                out[name] = monitor
        return out

    def check_duplicate_scrapes(self) -> None:
        if not self.settings.service_monitor_served:
            return
        targets = []
        for name in (EXPORTER, EXPORTER_DRA):
            key: ObjectKey = ("Service", name)
            if key in self.desired and self.will_manage(key):
                body = self.desired[key].body
                targets.append(
                    ScrapeTarget(name, labels_of(body), annotations_of(body).get(SCRAPE_ANNOTATION))
                )
            elif key in self.live and not (is_managed(self.live[key]) and key not in self.desired):
                live = self.live[key]
                targets.append(
                    ScrapeTarget(name, labels_of(live), annotations_of(live).get(SCRAPE_ANNOTATION))
                )
        # Ours, and the same-named ones this plan adopts, are not duplicates: they are kept.
        monitors = [
            sm
            for sm in self.world.service_monitors
            if isinstance(sm, dict)
            and in_namespace(sm, self.settings.namespace)
            and not is_managed(sm)
            and name_of(sm) not in self.kept_monitors
        ]
        pending, reports = duplicate_scrape_targets(
            monitors, targets, self.ours_selects(), self.settings.namespace
        )
        self.pending.extend(pending)
        self.reports.extend(reports)

    def _collect(self, *resolutions: Resolution) -> None:
        for resolution in resolutions:
            if resolution.conflict is not None:
                self.resolutions.append(resolution)
                self.reports.extend(conflict_reports(resolution))

    def _service_report(
        self, type_: str, reason: str, name: str, text: str, identity: str
    ) -> Report:
        live = self.live.get(("Service", name))
        uid = meta(live).get("uid") if live is not None else None
        return Report(
            "Warning" if type_ == "Warning" else "Normal",
            reason,
            "Reconcile",
            ObjectRef(SERVICE_API, "Service", name, self.settings.namespace, uid or None),
            note(text),
            key=f"{reason}/Service/{name}/{identity}",
        )

    def actions(self) -> list[tuple[Action, K8sObject | None]]:
        pairs: list[tuple[Action, K8sObject | None]] = []
        for key, desired in self.desired.items():
            live = self.live.get(key)
            action = action_for_desired(desired, live, self.settings.adopt)
            pairs.append((action, live))
            if action.action == "skip":
                message = (
                    f"{desired.kind} {desired.name} exists but is not managed by shared-svc and "
                    + (
                        "has owners other than ClusterPolicy/GPUCluster"
                        if self.settings.adopt
                        else "adoption is disabled"
                    )
                    + "; left untouched"
                )
                self.pending.append(
                    Pending(f"{desired.kind}/{desired.name}", action.reason, message)
                )
                self.reports.append(
                    object_report(
                        "Warning", action, live, message, "Reconcile", self.settings.namespace
                    )
                )
        for key, live in self.live.items():
            if key in self.desired:
                continue
            kind: ManagedKind = "Service" if key[0] == "Service" else "ServiceMonitor"
            unneeded = action_for_unneeded(kind, key[1], live)
            now = self.world.now  # None (an offline plan, no clock): deleted at once
            if (
                unneeded is not None
                and unneeded.action == "delete"
                and kind == "ServiceMonitor"
                and now is not None
            ):
                unneeded, wait = going_away(
                    key[1], live, now, self.settings.scrape_interval_seconds
                )
                if wait is not None:
                    self.waits.append(wait)
            if unneeded is not None:
                pairs.append((unneeded, live))
        ns = self.settings.namespace
        announced = [(announce(action, live, ns), live) for action, live in pairs]
        self.reports.extend(r for action, _ in announced for r in action.announces)
        return announced

    def manifest(self, desired: Desired) -> K8sObject:
        """What the object will be: our intent plus the foreign references that are kept.
        Not a deep copy: it shares the intent's nested values with the apply body (a
        plan's objects and actions are read, never changed)."""
        body = desired.body
        refs = kept_owner_refs(self.live.get((desired.kind, desired.name)), desired.owners)
        return {**body, "metadata": {**body["metadata"], "ownerReferences": refs}}


def object_statuses(
    needs: Needs, live: Mapping[ObjectKey, K8sObject], choices: Mapping[str, SelectorChoice]
) -> tuple[ObjectStatus, ...]:
    """What ``status`` shows of each object a CR needs or we manage: who needs it, the
    selector chosen for a Service and what gates or holds it back."""
    keys = set(needs.by_object) | {k for k, v in live.items() if is_managed(v)}
    out = []
    for kind, name in sorted(keys):
        needed_by = tuple(cr.label for cr in needs.needed_by((kind, name)))
        choice = choices.get(name) if kind == "Service" else None
        out.append(
            ObjectStatus(
                "Service" if kind == "Service" else "ServiceMonitor",
                name,
                needed_by,
                selector=dict(choice.selector) if choice else None,
                gates=choice.gates if choice else (),
                held_back=dict(choice.held_back) if choice and choice.held_back else None,
            )
        )
    return tuple(out)


def announce(action: Action, live: K8sObject | None, namespace: str) -> Action:
    """The action carrying the object it was planned against and the Normal report of
    a write worth an Event (``announces``; also in the plan's reports); sent after the
    write succeeds."""
    action = dataclasses.replace(action, live=live)
    verbs = {
        "Created": "Create",
        "Adopted": "Adopt",
        "Deleted": "Delete",
        "SelectorMigrated": "MigrateSelector",
    }
    verb = next((v for suffix, v in verbs.items() if action.reason.endswith(suffix)), None)
    if verb is None or action.action in ("skip", "unchanged"):
        return action
    if action.reason == "SelectorMigrated" and live is not None and action.apply is not None:
        old, new = spec(live).get("selector"), action.apply["spec"]["selector"]
        text = f"Service {action.name}: selector {_selector_text(old)} -> {_selector_text(new)}"
    else:
        text = f"{action.kind} {action.name}: {action.reason}"
        if action.apply is not None:
            owners = ", ".join(
                f"{r['kind']}/{r['name']}" for r in action.apply["metadata"]["ownerReferences"]
            )
            text += f" (owners: {owners or 'none'})"
    report = object_report("Normal", action, live, text, verb, namespace)
    return dataclasses.replace(action, announces=(report,))


def object_report(
    type_: str, action: Action, live: K8sObject | None, text: str, verb: str, namespace: str
) -> Report:
    """The report of a planned write of ours to an object in ``namespace``."""
    uid = meta(live).get("uid") if live is not None else None
    api = SERVICE_API if action.kind == "Service" else SERVICE_MONITOR_API
    # One occurrence per reason, object and note: a repeat (an adoption fight) bumps the
    # series of one Event. Not the patch: its resourceVersion differs on every repeat.
    identity = stable_digest([uid, text])
    return Report(
        "Warning" if type_ == "Warning" else "Normal",
        action.reason,
        verb,
        ObjectRef(api, action.kind, action.name, namespace, uid or None),
        note(text),
        key=f"{action.reason}/{action.kind}/{action.name}/{identity}",
        after_write=(action.kind, action.name) if type_ == "Normal" else None,
    )


def _selector_text(selector: object) -> str:
    if not isinstance(selector, Mapping):
        return "(none)"
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def plan(world: World, settings: Settings) -> Plan:
    """Desired Services and ServiceMonitors, the writes to get there, and what to report."""
    planner = _Planner(world, settings)
    errors = planner.spec_errors()
    planner.plan_services()
    planner.plan_service_monitors()
    planner.check_duplicate_scrapes()
    pairs = planner.actions()
    ordered = order_actions(pairs)
    objects = sorted(
        (planner.manifest(d) for d in planner.desired.values() if _kept(d, ordered)),
        key=lambda o: (o["kind"], o["metadata"]["name"]),
    )
    conflicts = sorted(
        (r.conflict for r in planner.resolutions if r.conflict is not None),
        key=lambda c: (c.object, c.field),
    )
    return Plan(
        objects=tuple(objects),
        actions=ordered,
        conflicts=tuple(conflicts),
        pending=tuple(sorted(planner.pending, key=lambda p: (p.object, p.reason))),
        errors=tuple(errors),
        reports=tuple(sorted(planner.reports, key=lambda r: r.key)),
        status=object_statuses(planner.needs, planner.live, planner.choices),
        notes=tuple(planner.notes),
        recheck_after=min(planner.waits, default=None),
    )


def _kept(desired: Desired, actions: tuple[Action, ...]) -> bool:
    return any(
        a.kind == desired.kind
        and a.name == desired.name
        and a.action in ("create", "update", "unchanged")
        for a in actions
    )


__all__ = ["CRSpec", "live_objects", "plan"]
