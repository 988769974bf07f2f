"""The upgrade flow's own gate, ``waitForCompletion.podSelector``: does it hold for our consumers?

gpu-operator's upgrade flow (k8s-operator-libs) moves a node from ``cordon-required`` to
``pod-restart-required`` within about a second and deletes the driver pod right after; it
waits for nothing it does not know. Its one gate is the upgrade policy's
``waitForCompletion.podSelector``: in ``wait-for-jobs-required`` it holds the node until no
pod matching that selector runs there (a terminating pod still counts). With the gate
selecting every consumer shared-svc frees (declared pods, and the pods of prepared
DaemonSets, whose template carries the same label), freeing never races the driver restart.
Without it, a consumer with a termination grace period still holds the GPU when the new
driver pod unloads the module.

The gate is judged where gpu-operator reads it (``upgrade.policy``): one verdict per policy
source (the ClusterPolicy in ClusterPolicy mode, each NVIDIADriver in NVIDIADriver mode),
each naming the nodes it governs; a gate set on a policy gpu-operator does not read in its
mode is shown as unread and never makes a verdict ``ok``.

Pure: the policy sources, the nodes in the flow and the consumer selector in, the verdicts
and their Warnings out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from dataclasses import replace as replace_policy
from typing import Any, Literal

from shared_svc.k8s import objects
from shared_svc.k8s.events import ObjectRef, Report
from shared_svc.k8s.objects import K8sObject
from shared_svc.k8s.selectors import Selector, SelectorError, parse_selector
from shared_svc.upgrade.policy import Mode, PolicySources, UpgradePolicy

# ok: the gate selects the consumers. missing: no podSelector. mismatch: a podSelector
# that does not select them. invalid: a podSelector that does not parse. off: autoUpgrade
# is off (or sandbox workloads on): no flow, nothing to gate. absent: no policy source.
GateState = Literal["ok", "missing", "mismatch", "invalid", "off", "absent"]
WARNING_STATES: frozenset[str] = frozenset({"missing", "mismatch", "invalid"})
# From the worst to the best: the one state a summary shows (``GateVerdicts.state``).
STATE_ORDER: tuple[GateState, ...] = ("invalid", "mismatch", "missing", "ok", "off", "absent")

# Set by configure-gate when the policy has none (0, the CRD default, waits forever): the
# eviction timeout (300 s), a grace period and the flow's 2-minute requeue fit in it.
DEFAULT_GATE_TIMEOUT_SECONDS = 600
# A verdict names at most this many of the nodes it governs (and counts them all).
NODES_NAMED = 20


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
class GateCheck:
    """The verdict on one policy source's gate (or ``absent``: no source at all)."""

    state: GateState
    policy: str | None  # "ClusterPolicy/<name>", "NVIDIADriver/<name>"; None: absent
    pod_selector: str
    timeout_seconds: int
    wanted: str  # the selector the gate should hold: the declared consumer label
    message: str
    field: str = ""  # where gpu-operator reads the gate in this object
    governs: str = ""  # which nodes the source governs ("every node", "the nodes labelled ...")
    nodes: tuple[
        str, ...
    ] = ()  # of the nodes in the upgrade flow, the first NODES_NAMED it governs
    node_count: int = 0  # how many nodes in the upgrade flow it governs

    @property
    def warns(self) -> bool:
        return self.state in WARNING_STATES

    @property
    def kind(self) -> str:
        return (self.policy or "/").partition("/")[0]

    @property
    def name(self) -> str:
        return (self.policy or "/").partition("/")[2]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes)}


def _selects(gate: Selector, labels: Mapping[str, str]) -> bool:
    """AND-only, as the flow's ``labels.Parse``: every requirement must hold on the consumer labels."""
    return gate.matches(labels)


def _wanted(consumer_selector: Selector) -> tuple[dict[str, str], str]:
    try:
        labels: dict[str, str] = consumer_labels(consumer_selector)
    except NoConsumerLabel:
        return {}, ""
    return labels, label_text(labels)


# What a gate that does not hold the flow for the consumers lets happen.
_RACE = (
    "freeing GPU consumers races the driver restart (the flow reaches pod-restart-required "
    "about a second after cordon-required and does not wait for consumers still terminating)"
)


def _fix(gate_field: str, wanted: str) -> str:
    """What to do about a gate that does not hold the flow for the consumers ``wanted``."""
    if wanted:
        return (
            f"set {gate_field} to {wanted!r} with waitForCompletion.timeoutSeconds > 0 "
            "(`shared-svc upgrade configure-gate`), and prepare every consumer DaemonSet "
            "(`shared-svc upgrade prepare-daemonset`)"
        )
    return f"set upgrade_consumer_selector to a label selector and {gate_field} to the same label"


def check_policy(
    policy: UpgradePolicy | None,
    consumer_selector: Selector,
    *,
    absent: str = "no ClusterPolicy: no upgrade flow to gate",
    unread: str = "",
) -> GateCheck:
    """The verdict on ``policy``'s gate (None: ``absent``, which says why there is none).
    ``unread``: a note on gates set where gpu-operator does not read them, added to a
    verdict that warns."""
    labels, wanted = _wanted(consumer_selector)
    if policy is None:
        return GateCheck("absent", None, "", 0, wanted, absent)
    where, gate_field = policy.where, policy.gate_field
    selector, timeout = policy.pod_selector, policy.timeout_seconds

    def verdict(state: GateState, message: str) -> GateCheck:
        if state in WARNING_STATES and unread:
            message = f"{message} {unread}"
        return GateCheck(
            state, where, selector, timeout, wanted, message, gate_field, policy.governs
        )

    if not policy.auto_upgrade:
        return verdict(
            "off", f"{where}: driver auto-upgrade is off ({policy.off}): nothing to gate"
        )
    fix = _fix(gate_field, wanted)
    if not selector.strip():
        return verdict("missing", f"{where} has no {gate_field}: {_RACE}; {fix}.")
    try:
        gate = parse_selector(selector)
    except SelectorError as exc:
        return verdict("invalid", f"{where}: {gate_field} does not parse ({exc}): {_RACE}; {fix}.")
    if not labels or not _selects(gate, labels):
        return verdict(
            "mismatch",
            f"{where}: {gate_field} {selector!r} does not select the declared GPU consumers "
            f"({wanted or consumer_selector.text!r}; the selector is AND-only): {_RACE}; {fix}. "
            "Pods the selector gates today (Jobs) must carry the same label.",
        )
    note = (
        ""
        if timeout > 0
        else " (timeoutSeconds 0: a consumer recreated on the node holds it forever; set timeoutSeconds > 0)"
    )
    return verdict(
        "ok",
        f"{where}: {gate_field} {selector!r} holds the flow for the declared GPU consumers "
        f"on {policy.governs}{note}",
    )


@dataclass(frozen=True)
class GateVerdicts:
    """The review of the gate: how gpu-operator picks its policy now, one verdict per source
    it reads, the gates it does not read, and the nodes in the flow no source governs."""

    mode: Mode
    why: str
    checks: tuple[GateCheck, ...]
    unread: tuple[str, ...] = ()  # "Kind/name: podSelector" of gates gpu-operator does not read
    ungoverned: tuple[str, ...] = ()  # the first NODES_NAMED nodes in the flow no source governs
    ungoverned_count: int = 0
    reports: tuple[Report, ...] = ()  # the Warnings, one per source whose gate does not hold

    @property
    def state(self) -> GateState:
        """The worst verdict (the one-line summary of ``upgrade status``)."""
        return min((c.state for c in self.checks), key=STATE_ORDER.index, default="absent")

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "why": self.why,
            "state": self.state,
            "verdicts": [c.as_dict() for c in self.checks],
            "unread": list(self.unread),
            "ungoverned": list(self.ungoverned),
            "ungoverned_count": self.ungoverned_count,
        }


def review_gate(
    sources: PolicySources,
    consumer_selector: Selector,
    nodes: Iterable[K8sObject] = (),
) -> GateVerdicts:
    """The verdicts on the gates gpu-operator reads (``sources``), for ``/status``, the
    metric and ``upgrade status``, each naming the nodes it governs among ``nodes`` (the
    nodes in the upgrade flow), and the Warning of each that does not hold."""
    governed: dict[str, list[str]] = {p.where: [] for p in sources.policies}
    ungoverned: list[str] = []
    if sources.mode != "none":
        for node in sorted(nodes, key=objects.name_of):
            policy = sources.governing(objects.labels_of(node))
            (governed[policy.where] if policy else ungoverned).append(objects.name_of(node))
    unread = tuple(f"{p.where}: {p.pod_selector!r}" for p in sources.unread if p.pod_selector)
    note = (
        f"gpu-operator does not read the gate of {', '.join(p.split(':')[0] for p in unread)} "
        f"in {sources.mode} mode ({sources.why})."
        if unread
        else ""
    )
    if not sources.policies:
        absent = (
            f"{sources.why}; no NVIDIADriver: no upgrade flow to gate"
            if sources.mode == "nvidia-driver"
            else f"{sources.why}: nothing to gate"
        )
        checks: tuple[GateCheck, ...] = (check_policy(None, consumer_selector, absent=absent),)
    else:
        checks = tuple(
            _naming(check_policy(p, consumer_selector, unread=note), governed[p.where])
            for p in sources.policies
        )
    reports = tuple(
        r
        for c, p in zip(checks, sources.policies, strict=False)
        if (r := gate_report(c, p)) is not None
    )
    return GateVerdicts(
        sources.mode,
        sources.why,
        checks,
        unread,
        tuple(ungoverned[:NODES_NAMED]),
        len(ungoverned),
        reports,
    )


def _naming(check: GateCheck, nodes: list[str]) -> GateCheck:
    return GateCheck(
        **{**asdict(check), "nodes": tuple(nodes[:NODES_NAMED]), "node_count": len(nodes)}
    )


def gate_report(check: GateCheck, policy: UpgradePolicy) -> Report | None:
    """The Warning on the object that holds the gate (Events about a cluster-scoped object
    go to ``default``), or None when the gate holds.

    The key names the object, the verdict and the selectors it was made from, so the same
    finding is one Event series (after a restart too) and a changed policy is a new one.
    """
    if not check.warns:
        return None
    regarding = ObjectRef(
        api_version=policy.api_version, kind=policy.kind, name=policy.name, uid=policy.uid
    )
    digest = hashlib.sha256(
        json.dumps([check.state, check.pod_selector, check.wanted]).encode()
    ).hexdigest()[:12]
    prefix = "upgrade-gate" if policy.owner is None else "upgrade-gate/nvidiadriver"
    return Report(
        "Warning",
        "GPUConsumerGateMissing" if check.state == "missing" else "GPUConsumerGateMismatch",
        "CheckUpgradePolicy",
        regarding,
        check.message,  # the Event note is cut to its limit in bytes (k8s.events.note)
        f"{prefix}/{policy.name}/{digest}",
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
    """The merge patch of the policy's object (the ClusterPolicy's
    ``spec.driver.upgradePolicy``, an NVIDIADriver's ``spec.upgradePolicy``) that makes its
    gate hold for the declared consumers.

    An existing selector that already selects them is kept (nothing to do; a timeout of 0 is
    raised to ``timeout_seconds``). Another existing selector is never replaced silently: it
    gates other pods (Jobs) today and, being AND-only, one selector cannot select both. The
    plan refuses and says what to do, unless ``replace`` (the user has put the consumer label
    on those pods too). A positive ``timeoutSeconds`` is kept.
    """
    wanted = label_text(consumer_labels(consumer_selector))  # raises NoConsumerLabel
    check = check_policy(replace_policy(policy, auto_upgrade=True), consumer_selector)
    where, gate_field = policy.where, policy.gate_field
    wait: dict[str, Any] = {}
    if check.state == "ok":
        if policy.timeout_seconds > 0:
            return GatePlan(
                "nothing",
                {},
                f"{where}: {gate_field} {policy.pod_selector!r} already selects the declared consumers ({wanted}): nothing to do",
            )
    elif check.state in ("mismatch", "invalid") and not replace:
        return GatePlan(
            "refuse",
            {},
            f"{where} already gates pods with {gate_field} {policy.pod_selector!r}, which does not "
            f"select the declared consumers ({wanted}); the selector is AND-only, so one selector "
            f"cannot select both: add the label {wanted} to the pods it gates today (the pod "
            "templates of your Jobs), then run again with --replace to set it to "
            f"{wanted!r}",
        )
    else:
        wait["podSelector"] = wanted
    if policy.timeout_seconds <= 0:
        wait["timeoutSeconds"] = timeout_seconds
    patch = objects.nested((*policy.policy_path, "waitForCompletion"), wait)
    return GatePlan(
        "set",
        patch,
        f"{where}: set {', '.join(f'waitForCompletion.{k}={v!r}' for k, v in wait.items())}",
    )
