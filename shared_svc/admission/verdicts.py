"""The guard judged from the API server's side (issue 43): pure rules of the guard probe.

The guard's webhooks are called with ``failurePolicy: Ignore``: where the API server cannot
reach them, every call fails open and nothing says so. The probe (``admission.probe``,
run by the leader every check, and once by ``shared-svc admission probe``, the chart's
``helm test``) asks the API server itself, with requests that change nothing:

- **delete**: a dry-run DELETE (``dryRun=All``) of a Service a CR needs, by shared-svc's
  own identity. The chart's ``matchConditions`` send the delete guard this request (and
  from shared-svc no other: only its dry runs), which answers it as gpu-operator's: 404,
  ``denied the request``. A 200 means the API server let it through; with the guard's
  warning (``rules.PROBE_ALLOWED``, "no plan yet") the guard answered "allowed".
- **update**: a dry-run JSON patch of the same Service shaped like gpu-operator's
  whole-object write (its labels, a controller reference to the CR, its selector): an
  UPDATE to admission, which the MutatingAdmissionPolicy or the mutating webhook answers
  by putting back everything shared-svc owns. The answer keeps shared-svc's fields, or the
  guard did not act.

Each verdict is one of :data:`REASONS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared_svc.admission.rules import managed_by_us
from shared_svc.reconcile.owners import cr_refs

SERVED = "served"  # the API server asked the guard and applied its answer
FAILS_OPEN = "fails_open"  # the API server let the request through unguarded
ANSWERED_WRONGLY = "answered_wrongly"  # the guard was asked, its answer is not the contract's
PROBE_FAILED = "probe_failed"  # the probe got no answer to judge (API error, RBAC, timeout)
NOT_PROBED = "not_probed"  # nothing to ask: no guard of this kind, no needed Service, standby
REASONS = (SERVED, FAILS_OPEN, ANSWERED_WRONGLY, PROBE_FAILED, NOT_PROBED)
FAILING = (FAILS_OPEN, ANSWERED_WRONGLY)
GUARDS = ("delete", "update")
PROBE_FIELD_MANAGER = "shared-svc-guard-probe"
# What the guard keeps of shared-svc's on a Service (rules.RESTORED, less managedFields:
# the answer of a dry run carries the API server's own).
KEPT = ("labels", "annotations", "ownerReferences")


@dataclass(frozen=True)
class Verdict:
    guard: str  # delete | update
    reason: str  # one of REASONS
    detail: str = ""
    target: str | None = None  # the Service asked about

    def as_status(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail, "target": self.target}


def probe_target(
    services: Iterable[Mapping[str, Any]],
    needed_by: Mapping[tuple[str, str], Sequence[str]] | None = None,
) -> Mapping[str, Any] | None:
    """The live Service the probe asks about: managed by shared-svc, owned by a CR (the
    update needs a CR to name as its controller), and, given shared-svc's last plan
    (``needed_by``), one a CR needs (the guard refuses its delete); the first by name."""
    for svc in sorted(services, key=lambda s: str((s.get("metadata") or {}).get("name", ""))):
        if svc.get("kind", "Service") != "Service" or not managed_by_us(svc) or not cr_refs(svc):
            continue
        name = str((svc.get("metadata") or {}).get("name", ""))
        if needed_by is not None and not needed_by.get(("Service", name)):
            continue
        return svc
    return None


def delete_verdict(
    status: int,
    message: str,
    warnings: Sequence[str],
    *,
    webhooks: Iterable[str],
    target: str | None = None,
) -> Verdict:
    """The dry-run DELETE's answer as the API server gave it: its HTTP status, the Status
    message of a refusal, the ``Warning`` headers; ``webhooks``: the delete guard's
    webhook names (the API server names the one that denied)."""
    denied = [w for w in webhooks if f'admission webhook "{w}" denied the request' in message]
    if denied:
        if status == 404:
            return Verdict("delete", SERVED, f"{status}: {message}"[:300], target)
        return Verdict(
            "delete",
            ANSWERED_WRONGLY,
            f"the guard refused with {status}, not 404 (gpu-operator would stall): {message}"[:300],
            target,
        )
    if 200 <= status <= 299:
        ours = [w for w in warnings if "shared-svc" in w]
        if ours:
            return Verdict(
                "delete",
                ANSWERED_WRONGLY,
                f"the guard was asked and allowed the delete: {ours[0]}"[:300],
                target,
            )
        return Verdict(
            "delete",
            FAILS_OPEN,
            "the API server allowed a delete the guard refuses: the guard's webhook was not "
            "called or did not answer (failurePolicy Ignore)",
            target,
        )
    return Verdict("delete", PROBE_FAILED, f"{status}: {message}"[:300], target)


def update_patch(live: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch that makes ``live`` what gpu-operator's whole-object PUT makes it:
    its own labels, a controller reference to a CR that owns it, its selector, no
    annotations of ours (gpu-operator.md section 9). ``live`` carries a CR reference."""
    meta = live.get("metadata") or {}
    name = str(meta.get("name", ""))
    ref = dict(cr_refs(live)[0])
    ref.update(controller=True, blockOwnerDeletion=False)
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
        {"op": "add", "path": "/metadata/labels", "value": {"app": name}},
        {"op": "add", "path": "/metadata/ownerReferences", "value": [ref]},
        {"op": "add", "path": "/spec/selector", "value": {"app": name}},
    ]
    if meta.get("annotations"):
        ops.append({"op": "remove", "path": "/metadata/annotations"})
    return ops


def kept(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the update guard keeps of shared-svc's on ``obj``."""
    meta = obj.get("metadata") or {}
    out: dict[str, Any] = {key: meta.get(key) or None for key in KEPT}
    out["spec"] = obj.get("spec")
    return out


def update_verdict(
    live: Mapping[str, Any], answer: Mapping[str, Any], *, target: str | None = None
) -> Verdict:
    """The dry-run update's answer (the object the API server would store) against the
    live object it was made from."""
    if kept(answer) == kept(live):
        return Verdict("update", SERVED, "the answer keeps shared-svc's fields", target)
    changed = sorted(k for k, v in kept(answer).items() if v != kept(live)[k])
    labels = (answer.get("metadata") or {}).get("labels") or {}
    name = (live.get("metadata") or {}).get("name")
    if labels == {"app": name}:
        return Verdict(
            "update",
            FAILS_OPEN,
            "the API server applied gpu-operator's shape unchanged (" + ", ".join(changed) + "): "
            "the guard's policy or webhook was not applied",
            target,
        )
    return Verdict(
        "update",
        ANSWERED_WRONGLY,
        "the answer changes shared-svc's " + ", ".join(changed),
        target,
    )


def worst(verdicts: Iterable[Verdict]) -> str | None:
    """The reason that matters most of several (the order of :data:`REASONS` reversed for
    the first two: a guard failing open outranks one answering wrongly); None: none."""
    order = (FAILS_OPEN, ANSWERED_WRONGLY, PROBE_FAILED, SERVED, NOT_PROBED)
    found = {v.reason for v in verdicts}
    return next((r for r in order if r in found), None)
