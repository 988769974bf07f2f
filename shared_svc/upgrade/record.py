"""Our node annotation: what this controller changed on the node, so restore is exact.

The record lives on the node itself (never only in memory), is written in the same
merge patch as the parked label, and is the only input the planner needs to undo its
changes after a restart. Format (JSON, keys sorted, times RFC 3339 UTC to the second)::

    {"version": 1,
     "since": "2026-08-21T10:00:00Z",        # first freeing plan of this upgrade
     "parkedLabel": true,                     # we set the parked label (so we remove it)
     "freedAt": "2026-08-21T10:00:40Z",       # every consumer gone; null while freeing
     "pods": [                                # every pod we asked to leave, by identity
       {"namespace": "ml", "name": "triton-0", "uid": "...",
        "firstAttempt": "2026-08-21T10:00:00Z",   # eviction clock: survives restarts
        "blocked": false,                        # Warning already reported
        "deleted": false}],                      # deleted after the timeout (opt-in)
     "detectedReported": ["ml/vst-0"]}        # report mode: consumers already reported

Written only when set (so records of earlier releases read and write back unchanged):
``"stuck": true`` on a pod (evicted, still terminating past the timeout: Warning
reported), ``"unpreparedReported": ["monitoring/exporter"]`` (DaemonSets running a
declared consumer that were never prepared: Warning reported) and
``"restartRace": ["ml/triton-0"]`` (freed consumers still on the node when it reached
``pod-restart-required``: Warning reported, once per upgrade), ``"pathEvidence": "guess"``
(a freeing record started in ``pod-restart-required``: what told the full path there,
``driver-pod``, ``changed`` or ``guess``; ``upgrade/paths.py``), and, on a node whose
driver restarts in place (nothing freed, nothing parked: ``pods`` empty, ``parkedLabel``
false), the restart-only verdict
``"restartOnly": {"daemonSet": "gpu-operator/nvidia-driver-daemonset", "digest": "..."}``
(the driver DaemonSet and the ``DRIVER_CONFIG_DIGEST`` it was decided on: reported once).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

RECORD_VERSION = 1
# Our own domain: gpu-operator and k8s-operator-libs never read or write it.
RECORD_DOMAIN = "shared-svc.nvidia.com"


def record_annotation_key(driver_name: str) -> str:
    """``shared-svc.nvidia.com/gpu-driver-upgrade-freed`` for the default driver ``gpu``.

    One record per driver name, so a gpu and an ofed controller can share a node.
    """
    return f"{RECORD_DOMAIN}/{driver_name}-driver-upgrade-freed"


class RecordError(ValueError):
    """The annotation is not a record this version understands."""


def format_time(seconds: float) -> str:
    return datetime.fromtimestamp(int(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> float:
    if not isinstance(text, str):
        raise RecordError(f"expected an RFC 3339 time, got {text!r}")
    try:
        return _seconds_of(text)
    except ValueError as exc:
        raise RecordError(f"bad time {text!r}") from exc


@functools.lru_cache(maxsize=4096)
def _seconds_of(text: str) -> float:
    """``strptime`` costs 0.1-0.2 ms, and every pass reads its node's record (three times or
    more: ``since``, each pod's ``firstAttempt``): the nodes of a wave share a few seconds,
    so a handful of texts (a failure is not kept: it raises each time)."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _second(seconds: float) -> float:
    """Times are kept at whole seconds so that encode(decode(text)) == text."""
    return float(int(seconds))


@dataclass(frozen=True)
class FreedPod:
    namespace: str
    name: str
    uid: str
    first_attempt: float
    blocked: bool = False
    deleted: bool = False
    stuck: bool = False  # evicted, but still terminating past the timeout: Warning reported

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class RestartOnly:
    """A restart-only verdict: the driver DaemonSet (namespace/name) and the digest of its
    template the verdict was decided on (it holds while the template keeps it)."""

    daemonset: str
    digest: str


@dataclass(frozen=True)
class Record:
    since: float
    parked_label: bool
    pods: tuple[FreedPod, ...] = ()
    freed_at: float | None = None
    detected_reported: tuple[str, ...] = field(default=())
    # DaemonSets (namespace/name) running a declared consumer, never prepared: Warning reported
    unprepared_reported: tuple[str, ...] = field(default=())
    # Consumers we freed still on the node at pod-restart-required: Warning reported
    restart_race: tuple[str, ...] = field(default=())
    # A freeing record started in pod-restart-required: the evidence of the full path there
    path_evidence: str | None = None
    # The node's driver restarts in place: nothing freed (``upgrade/paths.py``)
    restart_only: RestartOnly | None = None

    @staticmethod
    def new(now: float, *, parked_label: bool) -> Record:
        return Record(since=_second(now), parked_label=parked_label)

    def pod(self, key: str) -> FreedPod | None:
        for pod in self.pods:
            if pod.key == key:
                return pod
        return None

    def with_pod(self, pod: FreedPod) -> Record:
        """Add or replace (same namespace/name) one pod entry, keeping the order canonical."""
        others = [p for p in self.pods if p.key != pod.key]
        pod = replace(pod, first_attempt=_second(pod.first_attempt))
        return replace(self, pods=tuple(sorted([*others, pod], key=lambda p: p.key)))


def _pod_body(p: FreedPod) -> dict[str, Any]:
    body: dict[str, Any] = {
        "namespace": p.namespace,
        "name": p.name,
        "uid": p.uid,
        "firstAttempt": format_time(p.first_attempt),
        "blocked": p.blocked,
        "deleted": p.deleted,
    }
    if p.stuck:
        body["stuck"] = True
    return body


def encode(record: Record) -> str:
    body: dict[str, Any] = {
        "version": RECORD_VERSION,
        "since": format_time(record.since),
        "parkedLabel": record.parked_label,
        "freedAt": None if record.freed_at is None else format_time(record.freed_at),
        "pods": [_pod_body(p) for p in sorted(record.pods, key=lambda p: p.key)],
        "detectedReported": sorted(set(record.detected_reported)),
    }
    if record.unprepared_reported:
        body["unpreparedReported"] = sorted(set(record.unprepared_reported))
    if record.restart_race:
        body["restartRace"] = sorted(set(record.restart_race))
    if record.path_evidence is not None:
        body["pathEvidence"] = record.path_evidence
    if record.restart_only is not None:
        body["restartOnly"] = {
            "daemonSet": record.restart_only.daemonset,
            "digest": record.restart_only.digest,
        }
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise RecordError(f"{what}: expected a non-empty string, got {value!r}")
    return value


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise RecordError(f"{what}: expected true or false, got {value!r}")
    return value


def decode(text: str) -> Record:
    """Parse the annotation; raises ``RecordError`` for anything not written by ``encode``."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"not JSON: {exc.msg}") from exc
    if not isinstance(body, dict):
        raise RecordError("not a JSON object")
    if body.get("version") != RECORD_VERSION:
        raise RecordError(f"unknown record version {body.get('version')!r}")
    pods_raw = body.get("pods", [])
    reported = body.get("detectedReported", [])
    unprepared = body.get("unpreparedReported", [])
    raced = body.get("restartRace", [])
    if not all(isinstance(x, list) for x in (pods_raw, reported, unprepared, raced)):
        raise RecordError(
            "pods, detectedReported, unpreparedReported and restartRace must be lists"
        )
    pods = []
    for raw in pods_raw:
        if not isinstance(raw, dict):
            raise RecordError("pod entries must be objects")
        pods.append(
            FreedPod(
                namespace=_str(raw.get("namespace"), "pod namespace"),
                name=_str(raw.get("name"), "pod name"),
                uid=_str(raw.get("uid"), "pod uid"),
                first_attempt=parse_time(raw.get("firstAttempt")),
                blocked=_bool(raw.get("blocked", False), "blocked"),
                deleted=_bool(raw.get("deleted", False), "deleted"),
                stuck=_bool(raw.get("stuck", False), "stuck"),
            )
        )
    freed_at = body.get("freedAt")
    evidence = body.get("pathEvidence")
    if evidence is not None and evidence not in PATH_EVIDENCE:
        raise RecordError(f"unknown pathEvidence {evidence!r}")
    return Record(
        since=parse_time(body.get("since")),
        parked_label=_bool(body.get("parkedLabel"), "parkedLabel"),
        pods=tuple(sorted(pods, key=lambda p: p.key)),
        freed_at=None if freed_at is None else parse_time(freed_at),
        detected_reported=tuple(sorted({_str(k, "detectedReported") for k in reported})),
        unprepared_reported=tuple(sorted({_str(k, "unpreparedReported") for k in unprepared})),
        restart_race=tuple(sorted({_str(k, "restartRace") for k in raced})),
        path_evidence=evidence,
        restart_only=_restart_only(body.get("restartOnly")),
    )


# What told the full path in pod-restart-required (``paths.Evidence``, less what a record
# started in an earlier state or a still-true verdict says).
PATH_EVIDENCE = frozenset({"driver-pod", "changed", "guess"})


def _restart_only(raw: Any) -> RestartOnly | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"daemonSet", "digest"}:
        raise RecordError("restartOnly must be an object with daemonSet and digest")
    return RestartOnly(
        _str(raw["daemonSet"], "restartOnly daemonSet"), _str(raw["digest"], "restartOnly digest")
    )
