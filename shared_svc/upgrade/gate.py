"""The upgrade flow's own gate, ``waitForCompletion.podSelector``: does it hold for our consumers?

gpu-operator's upgrade flow (k8s-operator-libs) moves a node from ``cordon-required`` to
``pod-restart-required`` within about a second and deletes the driver pod right after; it
waits for nothing it does not know. Its one gate is the active ClusterPolicy's
``spec.driver.upgradePolicy.waitForCompletion.podSelector``: in ``wait-for-jobs-required``
it holds the node until no pod matching that selector runs there (a terminating pod still
counts). With the gate selecting every consumer shared-svc frees (declared pods, and the
pods of prepared DaemonSets, whose template carries the same label), freeing never races
the driver restart. Without it, a consumer with a termination grace period still holds the
GPU when the new driver pod unloads the module.

Pure: ClusterPolicy objects and the consumer selector in, a verdict out. The policy
source is the ClusterPolicy alone: in gpu-operator ``v0.0.0-20250917190837-d73a0086a6ba``
the upgrade controller reads ``ClusterPolicy.spec.driver.upgradePolicy`` in both modes
(NVIDIADriver mode too) and the NVIDIADriver CRD has no upgrade policy.
``check_gate`` takes any number of policies, so a source added later is one more entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.k8s.selectors import Selector, SelectorError, parse_selector
from shared_svc.reconcile.needs import active_cluster_policy
from shared_svc.reconcile.specs import CLUSTER_POLICY, parse_cr

# ok: the gate selects the consumers. missing: no podSelector. mismatch: a podSelector
# that does not select them. invalid: a podSelector that does not parse. off: autoUpgrade
# is off (or sandbox workloads on): no flow, nothing to gate. absent: no ClusterPolicy.
GateState = Literal["ok", "missing", "mismatch", "invalid", "off", "absent"]
WARNING_STATES: frozenset[str] = frozenset({"missing", "mismatch", "invalid"})

GATE_FIELD = "spec.driver.upgradePolicy.waitForCompletion.podSelector"
# Set by configure-gate when the policy has none (0, the CRD default, waits forever): the
# eviction timeout (300 s), a grace period and the flow's 2-minute requeue fit in it.
DEFAULT_GATE_TIMEOUT_SECONDS = 600


class NoConsumerLabel(ValueError):
    """The consumer selector has no requirement a label can satisfy (empty, or only ``!k``/``notin``)."""


def consumer_labels(selector: Selector) -> dict[str, str]:
    """The labels that declare a consumer: what prepare-daemonset puts on a pod template
    and configure-gate puts in the gate.

    ``k=v``/``k in (v)`` give ``k: v`` (``in`` with several values: the first, sorted);
    ``k`` (exists) gives ``k: "true"``; ``notin`` and ``!k`` add nothing (absence satisfies
    them). Raises ``NoConsumerLabel`` when the result does not match the selector.
    """
    labels: dict[str, str] = {}
    for req in selector.requirements:
        if req.operator == "In" and req.values:
            labels[req.key] = sorted(req.values)[0]
        elif req.operator == "Exists":
            labels.setdefault(req.key, "true")
    if not labels or not selector.matches(labels):
        raise NoConsumerLabel(
            f"the consumer selector {selector.text!r} names no label a pod can carry "
            "(use a selector like 'nvidia.com/gpu-driver-upgrade.consumer=true')"
        )
    return labels


def label_text(labels: Mapping[str, str]) -> str:
    """``k=v,k2=v2`` (sorted): the selector string that selects exactly these labels."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


@dataclass(frozen=True)
class UpgradePolicy:
    """What the gate check needs of one policy source (a ClusterPolicy today)."""

    kind: str
    api_version: str
    name: str
    uid: str | None
    auto_upgrade: bool
    pod_selector: str  # "" when unset
    timeout_seconds: int  # 0 (the CRD default) waits forever
    resource_version: str | None = None


def _dig(obj: Any, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def policy_of_cluster_policy(obj: K8sObject) -> UpgradePolicy:
    """Lenient: a field of the wrong type reads as unset (the API server's schema checks types)."""
    upgrade = _dig(obj, "spec", "driver", "upgradePolicy")
    auto = (
        _dig(upgrade, "autoUpgrade") is True
        and _dig(obj, "spec", "sandboxWorkloads", "enabled") is not True
    )
    selector = _dig(upgrade, "waitForCompletion", "podSelector")
    timeout = _dig(upgrade, "waitForCompletion", "timeoutSeconds")
    return UpgradePolicy(
        kind="ClusterPolicy",
        api_version=str(obj.get("apiVersion") or "nvidia.com/v1"),
        name=objects.name_of(obj),
        uid=objects.uid_of(obj) or None,
        auto_upgrade=auto,
        pod_selector=selector if isinstance(selector, str) else "",
        timeout_seconds=timeout
        if isinstance(timeout, int) and not isinstance(timeout, bool)
        else 0,
        resource_version=objects.resource_version_of(obj) or None,
    )


def active_policy(cluster_policies: Iterable[K8sObject]) -> K8sObject | None:
    """The ClusterPolicy gpu-operator acts on: the oldest not being deleted (as the Services controller picks)."""
    objs = [o for o in cluster_policies if isinstance(o, dict)]
    chosen = active_cluster_policy([parse_cr(CLUSTER_POLICY, o) for o in objs])
    if chosen is None:
        return None
    return next(o for o in objs if objects.name_of(o) == chosen.name)


@dataclass(frozen=True)
class GateCheck:
    state: GateState
    policy: str | None  # "ClusterPolicy/<name>"
    pod_selector: str
    timeout_seconds: int
    wanted: str  # the selector the gate should hold: the declared consumer label
    message: str

    @property
    def warns(self) -> bool:
        return self.state in WARNING_STATES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _selects(gate: Selector, labels: Mapping[str, str]) -> bool:
    """AND-only, as the flow's ``labels.Parse``: every requirement must hold on the consumer labels."""
    return gate.matches(labels)


def check_policy(policy: UpgradePolicy | None, consumer_selector: Selector) -> GateCheck:
    try:
        labels: dict[str, str] = consumer_labels(consumer_selector)
        wanted = label_text(labels)
    except NoConsumerLabel:
        labels, wanted = {}, ""
    if policy is None:
        return GateCheck("absent", None, "", 0, wanted, "no ClusterPolicy: no upgrade flow to gate")
    where = f"{policy.kind}/{policy.name}"
    selector, timeout = policy.pod_selector, policy.timeout_seconds
    if not policy.auto_upgrade:
        return GateCheck(
            "off",
            where,
            selector,
            timeout,
            wanted,
            f"{where}: driver auto-upgrade is off: nothing to gate",
        )
    fix = (
        f"set {GATE_FIELD} to {wanted!r} with waitForCompletion.timeoutSeconds > 0 "
        "(`shared-svc upgrade configure-gate`), and prepare every consumer DaemonSet "
        "(`shared-svc upgrade prepare-daemonset`)"
        if wanted
        else f"set upgrade_consumer_selector to a label selector and {GATE_FIELD} to the same label"
    )
    race = (
        "freeing GPU consumers races the driver restart (the flow reaches pod-restart-required "
        "about a second after cordon-required and does not wait for consumers still terminating)"
    )
    if not selector.strip():
        return GateCheck(
            "missing",
            where,
            selector,
            timeout,
            wanted,
            f"{where} has no {GATE_FIELD}: {race}; {fix}.",
        )
    try:
        gate = parse_selector(selector)
    except SelectorError as exc:
        return GateCheck(
            "invalid",
            where,
            selector,
            timeout,
            wanted,
            f"{where}: {GATE_FIELD} does not parse ({exc}): {race}; {fix}.",
        )
    if not labels or not _selects(gate, labels):
        return GateCheck(
            "mismatch",
            where,
            selector,
            timeout,
            wanted,
            f"{where}: {GATE_FIELD} {selector!r} does not select the declared GPU consumers "
            f"({wanted or consumer_selector.text!r}; the selector is AND-only): {race}; {fix}. "
            "Pods the selector gates today (Jobs) must carry the same label.",
        )
    note = (
        ""
        if timeout > 0
        else " (timeoutSeconds 0: a consumer recreated on the node holds it forever; set timeoutSeconds > 0)"
    )
    return GateCheck(
        "ok",
        where,
        selector,
        timeout,
        wanted,
        f"{where}: {GATE_FIELD} {selector!r} holds the flow for the declared GPU consumers{note}",
    )


def check_gate(
    cluster_policies: Iterable[K8sObject], consumer_selector: Selector
) -> tuple[GateCheck, Report | None]:
    """The verdict on the active ClusterPolicy's gate (for /status and ``upgrade status``),
    and the Warning to send about it (None when the gate holds or there is no flow)."""
    active = active_policy(cluster_policies)
    policy = None if active is None else policy_of_cluster_policy(active)
    check = check_policy(policy, consumer_selector)
    return check, None if policy is None else gate_report(check, policy)


def gate_report(check: GateCheck, policy: UpgradePolicy) -> Report | None:
    """The Warning on the ClusterPolicy (Events about it go to ``default``), or None when the gate holds.

    The key names the verdict and the selectors it was made from, so the same finding is one
    Event series (after a restart too) and a changed policy is a new one.
    """
    if not check.warns:
        return None
    regarding = ObjectRef(
        api_version=policy.api_version, kind=policy.kind, name=policy.name, uid=policy.uid
    )
    digest = hashlib.sha256(
        json.dumps([check.state, check.pod_selector, check.wanted]).encode()
    ).hexdigest()[:12]
    return Report(
        "Warning",
        "GPUConsumerGateMissing" if check.state == "missing" else "GPUConsumerGateMismatch",
        "CheckUpgradePolicy",
        regarding,
        check.message,  # the Event note is cut to its limit in bytes (k8s.events.note)
        f"upgrade-gate/{policy.name}/{digest}",
    )


# --- configure-gate ---

GateAction = Literal["set", "nothing", "refuse"]


@dataclass(frozen=True)
class GatePlan:
    action: GateAction
    patch: dict[str, Any]  # the merge patch (without resourceVersion), {} when nothing/refuse
    message: str


def plan_gate(
    policy: UpgradePolicy,
    consumer_selector: Selector,
    *,
    replace: bool = False,
    timeout_seconds: int = DEFAULT_GATE_TIMEOUT_SECONDS,
) -> GatePlan:
    """The ClusterPolicy merge patch that makes the gate hold for the declared consumers.

    An existing selector that already selects them is kept (nothing to do; a timeout of 0 is
    raised to ``timeout_seconds``). Another existing selector is never replaced silently: it
    gates other pods (Jobs) today and, being AND-only, one selector cannot select both. The
    plan refuses and says what to do, unless ``replace`` (the user has put the consumer label
    on those pods too). A positive ``timeoutSeconds`` is kept.
    """
    wanted = label_text(consumer_labels(consumer_selector))  # raises NoConsumerLabel
    check = check_policy(
        UpgradePolicy(**{**asdict(policy), "auto_upgrade": True}), consumer_selector
    )
    where = f"{policy.kind}/{policy.name}"
    wait: dict[str, Any] = {}
    if check.state == "ok":
        if policy.timeout_seconds > 0:
            return GatePlan(
                "nothing",
                {},
                f"{where}: {GATE_FIELD} {policy.pod_selector!r} already selects the declared consumers ({wanted}): nothing to do",
            )
    elif check.state in ("mismatch", "invalid") and not replace:
        return GatePlan(
            "refuse",
            {},
            f"{where} already gates pods with {GATE_FIELD} {policy.pod_selector!r}, which does not "
            f"select the declared consumers ({wanted}); the selector is AND-only, so one selector "
            f"cannot select both: add the label {wanted} to the pods it gates today (the pod "
            "templates of your Jobs), then run again with --replace to set it to "
            f"{wanted!r}",
        )
    else:
        wait["podSelector"] = wanted
    if policy.timeout_seconds <= 0:
        wait["timeoutSeconds"] = timeout_seconds
    patch = {"spec": {"driver": {"upgradePolicy": {"waitForCompletion": wait}}}}
    return GatePlan(
        "set",
        patch,
        f"{where}: set {', '.join(f'waitForCompletion.{k}={v!r}' for k, v in wait.items())}",
    )
