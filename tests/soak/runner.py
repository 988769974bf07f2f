"""The soak's loop: each step of the seed's history made on the real parties, then the
invariants checked against the model (see tests/soak/__init__.py).

After every step, once the world settles (bounded: :data:`SETTLE`):
- every Service the model needs exists, managed by shared-svc, with exactly one
  non-controller reference per CR that needs it (their live uids);
- no Service the model does not need is managed by shared-svc; ServiceMonitors are kept
  exactly when a valid CR asks for one;
- every ready exporter pod of a stack that needs its exporter is scraped through exactly
  one Service with scrape "true", and each such Service is selected by exactly one kept
  ServiceMonitor (one with "false" by none); every ready DCGM pod of the ClusterPolicy
  stack is selected by ``nvidia-dcgm`` (the stand-ins of tests/soak/world.py run the pods
  and the DRA DaemonSets, whose rollouts add and remove the common labels);
- a Service needed before and after the step kept its uid and clusterIP, unless the step
  explains it: the collector deleting a Service whose only owner the step deleted (the
  contract's "documented, not fought"), or gpu-operator's delete of a Service its own
  ClusterPolicy turns off passing while the delete webhook could not answer (the ``guard``
  fault, or a frozen replica the webhook's Service still sends calls to);
- shared-svc's writes come to rest (no write for :data:`QUIET` seconds);
- no traceback, no line that is not a log record, and no ERROR in a replica's log that
  the step does not explain (:data:`EXPLAINED_ERRORS`); its warnings are counted by
  message in the report; gpu-operator still runs;
- the driver-upgrade side (tests/soak/upgrades.py): with a ClusterPolicy active, every
  node upgrade-done, uncordoned, on the newest driver revision, nothing of shared-svc's
  left on it, its consumers back; with none, no upgrade state and nothing parked; no
  driver unload that waited for a consumer; the restart-only path restarted the driver in
  place on every node, and no other step did.
All the time: at most one replica says it leads; no consumer asked to go, and no node
parked, outside the freeing states or on a step that frees nothing; ``nvidia-dcgm`` never
moved to a selector covering fewer nodes (tests/soak/timeline.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import testenv
from shared_svc.k8s.selectors import label_selector, selector_from_set
from tests.soak import model as m
from tests.soak.api import Unanswered
from tests.soak.timeline import ready
from tests.soak.world import START, Replica, World, start_world, stop_world

LEASE = 15.0  # the shipped lease duration (values.yaml: leaderElection)
SETTLE = 120.0  # a leader killed: the Lease (15 s) runs out first, then a resync
# A driver upgrade: two nodes one after the other, each freed (its consumers' 5 s grace),
# its driver restarted and validated, with a fault on the way.
SETTLE_UPGRADE = 300.0
QUIET = 1.5  # no write for this long: at rest (shared-svc coalesces events for 0.2 s)
MANAGED = ("app.kubernetes.io/managed-by", "shared-svc")
# ERROR records a step explains, by its kind: the prefixes of their "msg". None so far:
# shared-svc logs ERROR only for what nothing expects (a controller or a periodic task
# ending on an exception), whatever the fault.
EXPLAINED_ERRORS: dict[str, tuple[str, ...]] = {}
TRACEBACK = "Traceback (most recent call last)"


def judge_log(lines: list[tuple[str, str]], kind: str) -> tuple[list[str], Counter[str]]:
    """The problems in the replicas' new log ``lines`` after a step of ``kind`` (a line
    that is not a JSON record, a traceback, an ERROR the step does not explain), and
    their warnings counted by message."""
    problems: list[str] = []
    warnings: Counter[str] = Counter()
    for replica, line in lines:
        if not line.strip() or line.startswith(START):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            problems.append(f"{replica}: not a log record: {line[:500]}")
            continue
        level = str(record.get("level", "")).lower()
        msg = str(record.get("msg", ""))
        if level in ("error", "critical"):
            if not (msg and msg.startswith(EXPLAINED_ERRORS.get(kind, ()))):
                problems.append(f"{replica}: {level} after a {kind} step: {line[:1500]}")
        elif TRACEBACK in line:
            problems.append(f"{replica}: a traceback at {level}: {line[:1500]}")
        elif level == "warning":
            warnings[msg] += 1
    return problems, warnings


@dataclass
class Report:
    seed: int
    steps: int = 0
    seconds: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)
    explained: Counter[str] = field(default_factory=Counter)  # identity changes explained
    warnings: Counter[str] = field(default_factory=Counter)  # the replicas' warnings, by msg
    upgrades: Counter[str] = field(default_factory=Counter)  # the steps' upgrade paths
    timeline: dict[str, int] = field(default_factory=dict)  # what the timeline judged
    leaders: list[str] = field(default_factory=list)  # the leading replica after each step
    interrupted: bool = False  # stopped by a signal, after a whole step
    violation: dict[str, Any] | None = None
    out: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "steps": self.steps,
            "seconds": round(self.seconds, 1),
            "kinds": dict(sorted(self.kinds.items())),
            "explained": dict(self.explained),
            "warnings": dict(self.warnings.most_common()),
            "upgrades": dict(sorted(self.upgrades.items())),
            "timeline": self.timeline,
            "leader_changes": sum(a != b for a, b in itertools.pairwise(self.leaders)),
            "violation": self.violation,
            "interrupted": self.interrupted,
        }


class Violation(Exception):
    def __init__(self, what: str, detail: Any = None) -> None:
        super().__init__(what)
        self.what = what
        self.detail = detail


def _cr_refs(obj: dict[str, Any]) -> list[tuple[str, str, str, str, bool]]:
    return [
        (r["apiVersion"], r["kind"], r["name"], r["uid"], bool(r.get("controller")))
        for r in obj["metadata"].get("ownerReferences") or []
        if r.get("kind") in (m.CP, m.GC)
    ]


def _managed(obj: dict[str, Any] | None) -> bool:
    return obj is not None and (obj["metadata"].get("labels") or {}).get(MANAGED[0]) == MANAGED[1]


def _api(kind: str) -> str:
    return "nvidia.com/v1" if kind == m.CP else "nvidia.com/v1alpha1"


class Soak:
    def __init__(
        self,
        world: World,
        seed: int,
        steps: int,
        budget: float,
        out: Path,
        progress: bool,
        history: list[tuple[m.Step, m.Model]] | None = None,
    ) -> None:
        self.progress = progress
        self.world = world
        self.seed = seed
        self.seeded = history is None
        self.history = m.history(seed, steps) if history is None else history
        self.stopping = asyncio.Event()  # set (SIGINT, SIGTERM): stop after the step
        self.budget = budget
        self.out = out
        self.report = Report(seed)
        self.done: list[m.Step] = []
        self.leaders: list[dict[str, Any]] = []  # moments two replicas said they lead
        self.fenced: tuple[Replica, float | None] | None = None  # a leader frozen past its Lease

    # --- the invariants -----------------------------------------------------------------

    def settled(self, model: m.Model) -> list[str]:
        """What does not hold yet of the settled world ``model`` promises (empty: all)."""
        w = self.world
        services = w.objects("services")
        monitors = w.objects("servicemonitors")
        problems = []
        uids = {cr.key: w.uid_of(cr.key) for cr in model.crs}
        needs = model.needs()
        for name in m.SERVICES:
            svc = services.get(name)
            needing = needs.get(name)
            if needing is None:
                if _managed(svc):
                    problems.append(f"{name}: managed by shared-svc, needed by no CR")
                continue
            if not _managed(svc):
                problems.append(f"{name}: needed by {sorted(needing)}, not managed (or absent)")
                continue
            assert svc is not None
            want = sorted((_api(k), k, n, uids[(k, n)] or "?", False) for k, n in needing)
            if _cr_refs(svc) != want:
                problems.append(f"{name}: owner references {_cr_refs(svc)}, want {want}")
            if name == m.EXPORTER:
                scrape = (svc["metadata"].get("annotations") or {}).get("prometheus.io/scrape")
                if scrape != "true":
                    problems.append(f"{name}: prometheus.io/scrape {scrape!r}, want 'true'")
        problems += self.scraped_once(model, services, monitors)
        if not any(cr.invalid for cr in model.crs):
            kept = any(_managed(mon) for mon in monitors.values())
            if kept != model.monitor_needed():
                problems.append(f"ServiceMonitors kept: {kept}, wanted {model.monitor_needed()}")
        if not w.op.alive():
            raise Violation("gpu-operator exited", w.op.tail())
        return problems

    def scraped_once(
        self,
        model: m.Model,
        services: dict[str, dict[str, Any]],
        monitors: dict[str, dict[str, Any]],
    ) -> list[str]:
        """Every ready exporter pod of a stack that needs its exporter is selected by exactly
        one exporter Service with scrape "true"; every ready DCGM pod of the ClusterPolicy
        stack by ``nvidia-dcgm`` while that stack needs it; each exporter Service with scrape
        "true" selected by exactly one kept ServiceMonitor, one with "false" by none."""
        needs = model.needs()
        managed = {n: s for n, s in services.items() if n in m.SERVICES and _managed(s)}
        scraping = {
            n: s
            for n, s in managed.items()
            if n in (m.EXPORTER, m.EXPORTER_DRA)
            and (s["metadata"].get("annotations") or {}).get("prometheus.io/scrape") == "true"
        }

        def selects(svc: dict[str, Any] | None, labels: dict[str, str]) -> bool:
            selector = (svc or {}).get("spec", {}).get("selector") or {}
            return bool(selector) and selector_from_set(selector).matches(labels)

        problems = []
        for pod in self.world.pods():
            labels = pod["metadata"].get("labels") or {}
            app = labels.get("app", "")
            is_ready = ready(pod)
            stack = m.CP if app in (m.DCGM, m.EXPORTER) else m.GC
            if not is_ready or not any(k[0] == stack for k in needs.get(app, ())):
                continue
            name = pod["metadata"]["name"]
            if app in (m.EXPORTER, m.EXPORTER_DRA):
                by = sorted(n for n, svc in scraping.items() if selects(svc, labels))
                if len(by) != 1:
                    problems.append(f"exporter pod {name} {labels}: scraped through {by}")
            elif app == m.DCGM and not selects(managed.get(m.DCGM), labels):
                problems.append(f"DCGM pod {name} {labels}: not selected by {m.DCGM}")
        kept = [mon for mon in monitors.values() if _managed(mon)]
        if kept:  # section 7: one kept ServiceMonitor per scraped Service, none for the rest
            for n, svc in managed.items():
                if n not in (m.EXPORTER, m.EXPORTER_DRA):
                    continue
                labels = svc["metadata"].get("labels") or {}
                by = sorted(
                    mon["metadata"]["name"]
                    for mon in kept
                    if label_selector(mon["spec"].get("selector") or {}).matches(labels)
                )
                if len(by) != (1 if n in scraping else 0):
                    problems.append(
                        f"{n} (scraped: {n in scraping}) selected by ServiceMonitors {by}"
                    )
        return problems

    def identities(self) -> dict[str, tuple[str, str]]:
        return {
            name: (s["metadata"]["uid"], s["spec"].get("clusterIP", ""))
            for name, s in self.world.objects("services").items()
            if name in m.SERVICES
        }

    @staticmethod
    def explained(step: m.Step, before: m.Model, name: str) -> str | None:
        """Why ``name`` may have a new identity after ``step`` (None: nothing explains it)."""
        needing = before.needs().get(name, frozenset())
        if step.change.endswith("-delete") and step.cr and needing == {step.cr.key}:
            return "collector"  # its only owner deleted
        if step.kind in ("guard", "freeze"):
            turned_off = set()
            for cr in before.crs + ((step.cr,) if step.cr else ()):
                if cr.kind == m.CP:
                    spec = cr.spec()
                    if spec.get("dcgm", {}).get("enabled") is False:
                        turned_off.add(m.DCGM)
                    if spec.get("dcgmExporter", {}).get("enabled") is False:
                        turned_off.add(m.EXPORTER)
            if name in turned_off:
                return f"gpu-operator's delete, {step.kind}"
        return None

    async def writes_rest(self) -> None:
        """shared-svc's writes stop (all replicas' counts unchanged for :data:`QUIET` s)."""
        deadline = time.monotonic() + 60

        def total() -> tuple[float | None, ...]:
            return tuple(r.writes() for r in self.world.replicas)

        last = await asyncio.to_thread(total)
        since = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            now = await asyncio.to_thread(total)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= QUIET and None not in now:
                return
        raise Violation("shared-svc's writes do not come to rest", {"writes": last})

    async def check_fenced(self, replica: Replica, before: float | None) -> None:
        """A leader frozen past its Lease wrote nothing after it continued, unless it leads
        again now (its writes are counted by its own /metrics)."""
        status = await asyncio.to_thread(replica.status)
        after = await asyncio.to_thread(replica.writes)
        if status and not status["leader"] and before is not None and after != before:
            raise Violation(
                "a leader frozen past its Lease wrote beside the next one",
                {"replica": replica.name, "writes": [before, after]},
            )

    async def watch_leaders(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            statuses = await asyncio.gather(
                *(asyncio.to_thread(r.status) for r in self.world.replicas)
            )
            leading = [
                r.name
                for r, s in zip(self.world.replicas, statuses, strict=True)
                if s and s["leader"]
            ]
            if len(leading) > 1:
                self.leaders.append({"at": time.time(), "replicas": leading})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.3)

    # --- the steps ----------------------------------------------------------------------

    def change(self, step: m.Step) -> None:
        if step.cr is None:
            return
        if step.change.endswith("-delete"):
            self.world.delete_cr(step.cr.key)
        else:
            self.world.apply_cr(step.cr)

    async def make(self, step: m.Step) -> None:
        w = self.world
        kind = step.kind
        if kind not in m.FAULTS:
            await asyncio.to_thread(self.change, step)
            return
        index = await asyncio.to_thread(w.replica_of, step.leader)
        replica = w.replicas[index]
        if kind == "kill":
            replica.signal(signal.SIGKILL)
            await asyncio.to_thread(self.change, step)
            await asyncio.to_thread(w.restart_replica, index, signal.SIGKILL)
        elif kind == "term":
            await asyncio.to_thread(w.restart_replica, index, signal.SIGTERM)
            await asyncio.to_thread(self.change, step)
        elif kind == "freeze":
            wrote = await asyncio.to_thread(replica.writes)
            replica.signal(signal.SIGSTOP)
            await asyncio.to_thread(self.change, step)
            await asyncio.sleep(step.seconds)
            replica.signal(signal.SIGCONT)
            if step.leader and step.seconds > LEASE:  # a standby leads now: the old one
                self.fenced = (replica, wrote)  # must not write (checked once settled)
        elif kind == "lease":
            await asyncio.to_thread(w.delete_lease)
            await asyncio.to_thread(self.change, step)
        elif kind == "apiserver":
            await asyncio.to_thread(w.cp.stop_apiserver)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(w.cp.start_apiserver)
            await asyncio.to_thread(self.change, step)
        elif kind == "etcd":
            await asyncio.to_thread(w.cp.kill_etcd)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(w.cp.start_etcd)
            await asyncio.to_thread(self.change, step)
        elif kind == "watches":
            w.api_proxy.drop()
            await asyncio.to_thread(self.change, step)
        elif kind == "rbac":
            await asyncio.to_thread(w.set_rbac, False)
            await asyncio.to_thread(self.change, step)
            await asyncio.sleep(step.seconds)
            await asyncio.to_thread(w.set_rbac, True)
        elif kind == "guard":
            w.webhook.freeze()
            await asyncio.to_thread(self.change, step)
            await asyncio.sleep(step.seconds)
            w.webhook.thaw()

    # --- the loop -----------------------------------------------------------------------

    async def settle(self, model: m.Model, bound: float = SETTLE) -> None:
        deadline = time.monotonic() + bound
        problems: list[str] = []
        while time.monotonic() < deadline:
            try:
                await asyncio.to_thread(self.world.sync, model)
                problems = await asyncio.to_thread(self.settled, model)
                problems += await asyncio.to_thread(self.world.upgrades.unsettled, model)
            except (Unanswered, testenv.ControlPlaneError) as exc:
                problems = [str(exc)]  # the API server is not back yet
            if not problems:
                return
            await asyncio.sleep(0.2)
        raise Violation(f"not settled after {bound:g} s", problems)

    def judge_upgrade(self, before: m.Model, after: m.Model) -> None:
        """The step's upgrade, and the timeline of its events (tests/soak/upgrades.py)."""
        up = self.world.upgrades
        path = m.upgrade_path(before, after)
        problems = up.judge(path)
        self.report.upgrades[path] += 1
        self.report.timeline = {
            "selector moves judged": up.timeline.moves,
            "consumers asked to go": len(up.timeline.asked),
            "freed on a guess of the path": up.timeline.guessed,
            "relists": up.timeline.gaps,
            "watch resumes": up.watcher.reconnects,
        }
        if problems:
            raise Violation(f"the {path} upgrade path broke", problems)

    async def run(self) -> Report:
        start = time.monotonic()
        stop = asyncio.Event()
        leaders = asyncio.ensure_future(self.watch_leaders(stop))
        before = m.Model()
        up = self.world.upgrades
        try:
            await self.settle(before)
            up.timeline.feed(up.watcher.take(), "setup")  # the world's start: not judged
            ids = await asyncio.to_thread(self.identities)
            for step, after in self.history:
                if time.monotonic() - start > self.budget or self.stopping.is_set():
                    self.report.interrupted = self.stopping.is_set()
                    break
                self.done.append(step)
                up.begin()
                try:
                    await self.make(step)
                except (OSError, AssertionError, testenv.ControlPlaneError) as exc:
                    raise Violation("the step could not be made", str(exc)) from exc
                upgrading = m.upgrade_path(before, after) != "none"
                await self.settle(after, SETTLE_UPGRADE if upgrading else SETTLE)
                await self.writes_rest()
                await self.settle(after)  # and still so at rest
                self.judge_upgrade(before, after)
                now = await asyncio.to_thread(self.identities)
                for name in set(before.needs()) & set(after.needs()):
                    if ids.get(name) == now.get(name):
                        continue
                    why = self.explained(step, before, name)
                    if why is None:
                        raise Violation(
                            f"{name} changed identity while needed", (ids.get(name), now[name])
                        )
                    self.report.explained[why] += 1
                if self.fenced is not None:
                    await self.check_fenced(*self.fenced)
                    self.fenced = None
                lines = await asyncio.to_thread(self.world.log_lines)
                errors, warnings = judge_log(lines, step.kind)
                self.report.warnings.update(warnings)
                if errors:
                    raise Violation("a replica logged what the step does not explain", errors)
                if self.leaders:
                    raise Violation("two replicas said they lead at once", self.leaders)
                self.report.kinds[step.kind] += 1
                self.report.steps += 1
                lead = await asyncio.to_thread(self.world.replica_of, True)
                self.report.leaders.append(self.world.replicas[lead].name)
                if self.progress:
                    took = time.monotonic() - start
                    print(
                        f"{took:8.1f}s {json.dumps(step.describe())}", file=sys.stderr, flush=True
                    )
                before, ids = after, now
        except Violation as v:
            self.report.violation = {
                "step": len(self.done) - 1,
                "what": v.what,
                "detail": v.detail,
            }
            await asyncio.to_thread(self.dump)
        finally:
            stop.set()
            await leaders
            self.report.seconds = time.monotonic() - start
        return self.report

    @property
    def replay(self) -> str:
        """The command that replays this run's history up to its last step."""
        if self.seeded:
            return f"make soak SEED={self.seed} STEPS={len(self.done)}"
        return f"python -m tests.soak --history {self.out / 'violation.json'}"

    def dump(self) -> None:
        """The seed, the history up to the failing step and the objects, under ``out``."""
        self.out.mkdir(parents=True, exist_ok=True)
        objects: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            objects = {
                "services": self.world.objects("services"),
                "servicemonitors": self.world.objects("servicemonitors"),
                "statuses": [r.status() for r in self.world.replicas],
                **self.world.upgrades.dump(),
            }
        (self.out / "violation.json").write_text(
            json.dumps(
                {
                    **self.report.as_dict(),
                    "history": [step.describe() for step in self.done],
                    "steps": [m.step_json(step) for step in self.done],
                    "objects": objects,
                    "replay": self.replay,
                    "logs": {r.name: str(r.log) for r in self.world.replicas},
                },
                indent=1,
                default=str,
            )
        )
        self.report.out = self.out


async def soak(
    workdir: Path,
    *,
    seed: int,
    steps: int,
    budget: float,
    plant: str = "",
    progress: bool = False,
    history: list[tuple[m.Step, m.Model]] | None = None,
) -> Report:
    """A whole soak in ``workdir``: the world started, the seed's history run (or
    ``history``: a scenario kept from a finding), stopped; ``progress``: a line on stderr
    per step."""
    world = await start_world(workdir, plant=plant)
    try:
        out = workdir / "violation"
        run = Soak(world, seed, steps, budget, out, progress, history)
        if progress:  # the command: SIGINT or SIGTERM ends it after the step in progress
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, run.stopping.set)
        return await run.run()
    finally:
        await stop_world(world)


async def shrink(
    workdir: Path, steps: list[m.Step], what: str, *, plant: str = "", budget: float = 3600.0
) -> tuple[list[m.Step], int]:
    """The failing history ``steps`` (its violation: ``what``) made shorter, greedily: each
    step but the last, the latest first, is dropped for good when the history without it
    (rebuilt: :func:`tests.soak.model.rebuild`) still ends in a violation of the same
    kind, in a world of its own. Returns the shortest history found and the runs it took
    (one per step that could be dropped: cheap next to the run that found it)."""
    current = list(steps)
    runs = 0
    i = len(current) - 2
    while i >= 0:
        candidate = m.rebuild(current[:i] + current[i + 1 :])
        if candidate is not None:
            runs += 1
            report = await soak(
                workdir / f"run-{runs}",
                seed=0,
                steps=len(candidate),
                budget=budget,
                plant=plant,
                history=candidate,
            )
            if report.violation is not None and report.violation["what"] == what:
                current = [step for step, _ in candidate[: report.violation["step"] + 1]]
                i = min(i, len(current) - 1)
        i -= 1
    return current, runs
