"""The soak's model (pure): the CRs as the steps leave them, what each needs, and the next
step, drawn from the seed and the model alone (a seed replays the same history).

The model is written from the contract (the design's section 2 and docs/reconcile.md), not
from shared-svc's core: it would share a bug with the code it checks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

CP, GC = "ClusterPolicy", "GPUCluster"
CP_NAME, CP2_NAME, GC_NAME = "cluster-policy", "cluster-policy-b", "gpu-cluster"
DCGM, DCGM_DRA = "nvidia-dcgm", "nvidia-dcgm-dra"
EXPORTER, EXPORTER_DRA = "nvidia-dcgm-exporter", "nvidia-dcgm-exporter-dra"
SERVICES = (DCGM, DCGM_DRA, EXPORTER, EXPORTER_DRA)
MONITOR = EXPORTER  # the ServiceMonitor shared-svc keeps for the exporter Services
TYPES = ("ClusterIP", "NodePort")
INVALID_TYPE = "Bogus"  # the CRDs take any string; only shared-svc judges it

# The faults, each whole in its step (made and undone), some with a CR change inside.
FAULTS = (
    "kill",  # a replica killed (-9) and started again, as its kubelet would
    "term",  # a replica stopped (SIGTERM) and started again
    "freeze",  # a replica stopped (SIGSTOP) for seconds (some past the Lease), continued
    "lease",  # the Lease deleted
    "apiserver",  # kube-apiserver restarted
    "etcd",  # etcd killed (-9) and started again
    "watches",  # every connection of the replicas to the API server cut
    "rbac",  # the replicas' bindings deleted for a few seconds, then restored
    "guard",  # the delete webhook unreachable for a few seconds
)
# The driver changes (gpu-operator's driver DaemonSet, as its ClusterPolicy controller writes
# it): a new driver version (the full upgrade path: consumers freed, parked, restored) or a
# new chart label only (a ``helm upgrade`` of gpu-operator: the restart-only path, nothing
# freed). The upgrade flow drives them while a ClusterPolicy is active (its upgradePolicy:
# :data:`UPGRADE_POLICY`); without one the change waits for the next ClusterPolicy.
DRIVER_CHANGES = ("driver-upgrade", "driver-restart")
UPGRADE_PATHS = {"driver-upgrade": "full", "driver-restart": "restart-only"}
CONSUMER_SELECTOR = "nvidia.com/gpu-driver-upgrade.consumer=true"
# Every ClusterPolicy of the soak: auto upgrade, one node at a time, the gate on the
# consumers shared-svc frees (`shared-svc upgrade configure-gate`'s selector).
UPGRADE_POLICY: dict[str, Any] = {
    "autoUpgrade": True,
    "maxParallelUpgrades": 1,
    "podDeletion": {"force": False, "timeoutSeconds": 300, "deleteEmptyDir": False},
    "drain": {"enable": False, "force": False, "timeoutSeconds": 300},
    "waitForCompletion": {"podSelector": CONSUMER_SELECTOR, "timeoutSeconds": 600},
}
WEIGHTS: dict[str, int] = {
    "cp-create": 3,
    "cp-delete": 1,
    "cp-edit": 6,
    "cp2-create": 1,
    "cp2-delete": 1,
    "gc-create": 3,
    "gc-delete": 1,
    "gc-edit": 6,
    "rollout": 2,  # the DRA DaemonSets' template gains the common labels, or loses them
    "driver-upgrade": 2,
    "driver-restart": 2,
    **dict.fromkeys(FAULTS, 1),
}
Key = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class CR:
    """A CR as the model knows it. ``None``: the field is unset (the stack's default)."""

    kind: str
    name: str
    born: int  # the step that created it: the oldest ClusterPolicy is the active one
    dcgm: bool | None = None
    exporter: bool | None = None  # GPUCluster: None is no dcgmExporter block at all
    service_type: str | None = None
    monitor: bool = False

    @property
    def key(self) -> Key:
        return (self.kind, self.name)

    @property
    def invalid(self) -> bool:
        return self.service_type == INVALID_TYPE

    def spec(self) -> dict[str, Any]:
        """The CR's spec (for a ClusterPolicy: what is merged into gpu-operator's)."""
        spec: dict[str, Any] = (
            {"draDriver": {}} if self.kind == GC else {"driver": {"upgradePolicy": UPGRADE_POLICY}}
        )
        if self.dcgm is not None:
            spec["dcgm"] = {"enabled": self.dcgm}
        exporter: dict[str, Any] = {}
        if self.exporter is not None:
            exporter["enabled"] = self.exporter
        if self.service_type is not None:
            exporter["service"] = {"type": self.service_type}
        if self.monitor:
            exporter["serviceMonitor"] = {"enabled": True}
        if exporter or (self.kind == GC and self.exporter is not None):
            spec["dcgmExporter"] = exporter
        return spec

    def own_needs(self) -> frozenset[str]:
        """The Services this CR needs by its own spec (section 2's tables: a ClusterPolicy's
        stacks are on unless turned off; a GPUCluster's DCGM only when turned on, its
        exporter when its block is there and not turned off)."""
        spec = self.spec()
        exporter_block = spec.get("dcgmExporter")
        dcgm_on = spec.get("dcgm", {}).get("enabled", self.kind == CP)
        if self.kind == CP:
            exporter_on = (exporter_block or {}).get("enabled", True)
        else:
            exporter_on = exporter_block is not None and exporter_block.get("enabled", True)
        names = set()
        if dcgm_on:
            names |= {DCGM} if self.kind == CP else {DCGM, DCGM_DRA}
        if exporter_on:
            names |= {EXPORTER} if self.kind == CP else {EXPORTER, EXPORTER_DRA}
        return frozenset(names)


@dataclass(frozen=True)
class Model:
    crs: tuple[CR, ...] = ()
    # What an invalid CR keeps needing: what it needed when it turned invalid.
    kept: tuple[tuple[Key, frozenset[str]], ...] = ()
    dra_common: bool = False  # the DRA DaemonSets' pods carry the common labels
    # The ClusterPolicy gpu-operator reconciles: the first it saw, for as long as it runs
    # (its controller's ``singleton``; any other is "ignored").
    operator_cp: str = ""
    # The driver gpu-operator's DaemonSet asks for, (version, chart) as counts of changes,
    # and the one the nodes run (the flow brings them to it while a ClusterPolicy is active).
    driver: tuple[int, int] = (0, 0)
    installed: tuple[int, int] = (0, 0)

    def get(self, key: Key) -> CR | None:
        return next((cr for cr in self.crs if cr.key == key), None)

    def with_cr(self, cr: CR) -> Model:
        old = self.get(cr.key)
        crs = (*(c for c in self.crs if c.key != cr.key), cr)
        kept = dict(self.kept)
        if cr.invalid and old is not None and not old.invalid:
            kept[cr.key] = self.needs_of(old)
        elif cr.invalid and old is None:
            kept[cr.key] = frozenset()
        elif not cr.invalid:
            kept.pop(cr.key, None)
        return replace(self, crs=crs, kept=tuple(sorted(kept.items())))

    def without(self, key: Key) -> Model:
        kept = tuple((k, v) for k, v in self.kept if k != key)
        return replace(self, crs=tuple(c for c in self.crs if c.key != key), kept=kept)

    def active_policy(self) -> CR | None:
        policies = sorted((c for c in self.crs if c.kind == CP), key=lambda c: (c.born, c.name))
        return policies[0] if policies else None

    def needs_of(self, cr: CR) -> frozenset[str]:
        if cr.kind == CP and cr is not self.active_policy():
            return frozenset()
        if cr.kind == GC and cr.name != GC_NAME:
            return frozenset()
        if cr.invalid:
            return dict(self.kept).get(cr.key, frozenset())
        return cr.own_needs()

    def needs(self) -> dict[str, frozenset[Key]]:
        """Each needed Service and the CRs that need it."""
        out: dict[str, set[Key]] = {}
        for cr in self.crs:
            for name in self.needs_of(cr):
                out.setdefault(name, set()).add(cr.key)
        return {name: frozenset(keys) for name, keys in out.items()}

    def normalized(self) -> Model:
        """What gpu-operator adds: it (re)creates ``nvidia-dcgm``, with its own reference,
        for the ClusterPolicy it reconciles while that one turns DCGM on and no Service of
        that name is kept. An invalid ClusterPolicy, whose ownership shared-svc keeps as it
        finds it (section 9), then owns it and keeps needing it."""
        if self.active_policy() is not None and self.installed != self.driver:
            return replace(self, installed=self.driver).normalized()
        cr = self.get((CP, self.operator_cp))
        active = self.active_policy()
        if cr is None or not cr.invalid or active is None or active.key != cr.key:
            return self
        if cr.spec().get("dcgm", {}).get("enabled", True) is False or DCGM in self.needs():
            return self
        kept = dict(self.kept)
        kept[cr.key] = kept.get(cr.key, frozenset()) | {DCGM}
        return replace(self, kept=tuple(sorted(kept.items())))

    def monitor_needed(self) -> bool:
        return any(
            cr.monitor and not cr.invalid and EXPORTER in self.needs_of(cr) for cr in self.crs
        )


def upgrade_path(before: Model, after: Model) -> str:
    """The upgrade the nodes went through from ``before`` to ``after``: ``full`` (a new
    driver version), ``restart-only`` (the chart label alone), or ``none``."""
    if before.installed[0] != after.installed[0]:
        return "full"
    return "restart-only" if before.installed != after.installed else "none"


def driver_changed(model: Model, change: str) -> Model:
    version, chart = model.driver
    return replace(
        model, driver=(version + 1, chart) if change == "driver-upgrade" else (version, chart + 1)
    )


@dataclass(frozen=True)
class Step:
    """One step: its kind, the model after it, and what the world must do."""

    index: int
    kind: str  # a CR change ("gc-edit") or a fault ("kill")
    change: str = ""  # the CR change of the step ("gc-edit"; a fault's, made while it lasts)
    cr: CR | None = None  # the CR created or edited (or, for a delete, the one deleted)
    leader: bool = True  # a replica fault hits the leader (else a standby)
    seconds: float = 0.0  # how long a fault lasts (freeze, rbac, guard)
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.index, "kind": self.kind}
        if self.change in ("rollout", *DRIVER_CHANGES):
            out["change"] = self.change
            out.update(self.detail)
        if self.cr is not None:
            out["change"] = self.change
            out["cr"] = {"kind": self.cr.kind, "name": self.cr.name, "spec": self.cr.spec()}
        if self.kind in ("kill", "term", "freeze"):
            out["replica"] = "leader" if self.leader else "standby"
        if self.seconds:
            out["seconds"] = self.seconds
        return out


def _edit(rng: random.Random, cr: CR) -> CR:
    """One field of ``cr`` changed (the exporter settings, a stack on or off, an invalid
    spec and its repair)."""
    what = rng.choice(("dcgm", "exporter", "type", "type", "monitor", "invalid"))
    if what == "dcgm":
        return replace(cr, dcgm=not cr.dcgm if cr.dcgm is not None else rng.choice((True, False)))
    if what == "exporter":
        choices: tuple[bool | None, ...] = (True, False) if cr.kind == CP else (True, False, None)
        return replace(cr, exporter=rng.choice([c for c in choices if c != cr.exporter]))
    if what == "monitor":
        return replace(cr, monitor=not cr.monitor)
    if what == "invalid":
        return replace(cr, service_type=None if cr.invalid else INVALID_TYPE)
    return replace(cr, service_type=rng.choice([*TYPES, None]))


def _new(rng: random.Random, kind: str, name: str, born: int) -> CR:
    if kind == CP:  # gpu-operator's own spec sets both
        return CR(kind, name, born, dcgm=rng.random() < 0.7, exporter=rng.random() < 0.8)
    return CR(
        kind,
        name,
        born,
        dcgm=rng.choice((True, False, None)),
        exporter=rng.choice((True, True, False, None)),
        service_type=rng.choice((None, None, *TYPES)),
        monitor=rng.random() < 0.3,
    )


def cr_change(rng: random.Random, model: Model, index: int) -> tuple[str, CR | None, Model]:
    """A change possible in ``model`` (a CR's, or a rollout of the DRA DaemonSets): its
    kind, the CR (None for a rollout), the model after it."""
    kinds = ["rollout", *DRIVER_CHANGES]
    for kind, name, prefix in ((CP, CP_NAME, "cp"), (CP, CP2_NAME, "cp2"), (GC, GC_NAME, "gc")):
        exists = model.get((kind, name)) is not None
        kinds += [f"{prefix}-delete"] if exists else [f"{prefix}-create"]
        if exists and prefix != "cp2":
            kinds.append(f"{prefix}-edit")
    step = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
    if step == "rollout":
        return step, None, replace(model, dra_common=not model.dra_common)
    if step in DRIVER_CHANGES:
        return step, None, driver_changed(model, step)
    prefix, _, verb = step.partition("-")
    kind, name = {"cp": (CP, CP_NAME), "cp2": (CP, CP2_NAME), "gc": (GC, GC_NAME)}[prefix]
    if verb == "create":
        cr = _new(rng, kind, name, index)
        if kind == CP and not model.operator_cp:
            model = replace(model, operator_cp=name)
        return step, cr, model.with_cr(cr)
    old = model.get((kind, name))
    assert old is not None
    if verb == "delete":
        return step, old, model.without(old.key)
    cr = _edit(rng, old)
    return step, cr, model.with_cr(cr)


def next_step(rng: random.Random, model: Model, index: int) -> tuple[Step, Model]:
    """The step ``index`` and the model after it; a CR change or a fault (with a CR change
    inside it half the time: a migration while the leader is killed)."""
    faults = sum(WEIGHTS[f] for f in FAULTS)
    changes = sum(w for k, w in WEIGHTS.items() if k not in FAULTS)
    if rng.random() < faults / (faults + changes):
        kind = rng.choice(FAULTS)
        change, cr = "", None
        if rng.random() < 0.5:
            change, cr, model = cr_change(rng, model, index)
        step = Step(
            index,
            kind,
            change=change,
            cr=cr,
            detail=_detail(change, model),
            leader=rng.random() < 0.5,
            seconds=round(rng.uniform(1.0, 4.0), 1),
        )
        if kind == "freeze" and rng.random() < 0.4:  # past the Lease (15 s): a standby leads
            step = replace(step, seconds=round(rng.uniform(17.0, 20.0), 1))
        return step, model.normalized()
    kind, cr, model = cr_change(rng, model, index)
    return Step(index, kind, change=kind, cr=cr, detail=_detail(kind, model)), model.normalized()


def _detail(change: str, model: Model) -> dict[str, Any]:
    """What a change that is not a CR's leaves, for the history."""
    if change == "rollout":
        return {"common": model.dra_common}
    if change in DRIVER_CHANGES:
        return {"driver": list(model.driver)}
    return {}


def history(seed: int, steps: int) -> list[tuple[Step, Model]]:
    """The whole history of ``seed``: every step and the model after it."""
    rng = random.Random(seed)
    model = Model()
    out = []
    for index in range(steps):
        step, model = next_step(rng, model, index)
        out.append((step, model))
    return out


# --- a history written out and read back, and rebuilt from its steps alone (shrinking) ---


def step_json(step: Step) -> dict[str, Any]:
    """``step`` whole, as JSON (:func:`step_from_json` reads it back)."""
    return asdict(step)


def step_from_json(data: dict[str, Any]) -> Step:
    cr = data.get("cr")
    return Step(**{**data, "cr": CR(**cr) if cr else None})


def _changed(model: Model, step: Step) -> Model | None:
    """The model after ``step``'s change, made as recorded (an edit sets the CR's fields
    as the step left them); None when the change cannot be made in ``model`` (a create of
    a CR there, an edit or delete of one not there)."""
    if not step.change:
        return model
    if step.change == "rollout":
        return replace(model, dra_common=bool(step.detail.get("common")))
    if step.change in DRIVER_CHANGES:
        return driver_changed(model, step.change)
    verb = step.change.rpartition("-")[2]
    if step.cr is None:
        return None
    live = model.get(step.cr.key)
    if verb == "create":
        if live is not None:
            return None
        if step.cr.kind == CP and not model.operator_cp:
            model = replace(model, operator_cp=step.cr.name)
        return model.with_cr(step.cr)
    if live is None:
        return None
    if verb == "delete":
        return model.without(live.key)
    return model.with_cr(replace(step.cr, born=live.born))


def rebuild(steps: Sequence[Step]) -> list[tuple[Step, Model]] | None:
    """The history of ``steps`` (renumbered) with the model after each, derived from the
    steps alone; None when one of them cannot be made after the ones before it. On a
    seed's own steps it gives back :func:`history` (tests/test_soak_pure.py)."""
    model = Model()
    out = []
    for index, step in enumerate(steps):
        after = _changed(model, step)
        if after is None:
            return None
        model = after.normalized()
        out.append((replace(step, index=index), model))
    return out
