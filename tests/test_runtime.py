"""The runtime under both controllers: work queue, rate limiters, controller helper."""

from __future__ import annotations

import ast
import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from shared_svc.runtime.controller import Controller, Options, Result
from shared_svc.runtime.instrumentation import RuntimeMetrics
from shared_svc.runtime.manager import Manager, Periodic
from shared_svc.runtime.workqueue import ShutDown, WorkQueue
from shared_svc.wait.ratelimit import (
    BucketRateLimiter,
    ItemExponentialFailureRateLimiter,
)
from shared_svc.wait.runnable import Runnable
from tests.kube import eventually


def test_exponential_limiter_doubles_per_key_caps_and_forgets() -> None:
    limiter = ItemExponentialFailureRateLimiter(0.005, 0.05)
    assert [limiter.when("a") for _ in range(5)] == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert limiter.when("b") == 0.01 and limiter.num_requeues("a") == 5
    limiter.forget("a")
    assert limiter.num_requeues("a") == 0 and limiter.when("a") == 0.01


def test_exponential_limiter_jitter_stays_in_its_band() -> None:
    random.seed(7)
    limiter = ItemExponentialFailureRateLimiter(1.0, 300.0, jitter=0.5)
    delays = []
    for _ in range(200):
        limiter.forget("k")
        delays.append(limiter.when("k"))
    assert all(1.0 <= d <= 2.0 for d in delays)
    assert len(set(delays)) > 1  # spread, not one value


def test_exponential_limiter_caps_the_exponent() -> None:
    limiter = ItemExponentialFailureRateLimiter(0.2, 1e9, max_exponent=10)
    delays = [limiter.when("k") for _ in range(12)]
    assert delays[-1] == delays[-2] == 0.2 * 2**10


def test_bucket_spends_the_burst_then_spaces_keys() -> None:
    bucket = BucketRateLimiter(10.0, 2, clock=lambda: 0.0)
    assert [bucket.when(k) for k in "abc"] == [0.0, 0.0, pytest.approx(0.1)]


async def test_bucket_take_spends_the_burst_then_waits_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writers' pacing: ``take`` spends a token; past the burst, concurrent takers
    wait in reservation order (1/rate apart), on a frozen clock."""
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    bucket = BucketRateLimiter(4.0, 2, clock=lambda: 0.0)
    await asyncio.gather(*(bucket.take() for _ in range(4)))
    assert slept == [0.25, 0.5]


async def test_queue_dedups_tracks_in_flight_and_requeues_after_done() -> None:
    registry = CollectorRegistry()
    queue: WorkQueue[str] = WorkQueue("q", metrics=RuntimeMetrics.of(registry))
    queue.add("a")
    queue.add("a")
    assert len(queue) == 1
    assert await queue.get() == "a"
    queue.add("a")  # changed while being handled: not handed out twice at once
    assert len(queue) == 0 and queue.pending("a")
    queue.done("a")
    assert len(queue) == 1
    assert await queue.get() == "a"
    queue.done("a")
    assert not queue.pending("a")
    assert registry.get_sample_value("workqueue_adds_total", {"name": "q"}) == 2
    assert registry.get_sample_value("workqueue_depth", {"name": "q"}) == 0


async def test_queue_delayed_adds_earlier_wins_and_add_now_subsumes() -> None:
    queue: WorkQueue[str] = WorkQueue("q")
    queue.add_after("b", 0.01)
    queue.add_after("b", 10)  # the earlier timer wins
    assert await asyncio.wait_for(queue.get(), 1) == "b"
    queue.done("b")
    queue.add_after("c", 10)
    queue.add("c")  # now: the later add is subsumed
    assert await asyncio.wait_for(queue.get(), 1) == "c"
    queue.done("c")
    await asyncio.sleep(0.02)
    assert len(queue) == 0 and not queue.pending("c")


async def test_queue_done_with_dirty_after_waits_before_the_rerun() -> None:
    queue: WorkQueue[str] = WorkQueue("q")
    queue.add("k")
    await queue.get()
    queue.add("k")
    queue.done("k", dirty_after=0.05)
    assert len(queue) == 0 and queue.pending("k")
    assert await asyncio.wait_for(queue.get(), 1) == "k"


async def test_rate_limited_adds_count_retries_and_forget_resets() -> None:
    registry = CollectorRegistry()
    queue: WorkQueue[str] = WorkQueue(
        "q",
        rate_limiter=ItemExponentialFailureRateLimiter(0.001, 0.01),
        metrics=RuntimeMetrics.of(registry),
    )
    assert queue.add_rate_limited("k") == 0.002
    assert queue.num_requeues("k") == 1
    assert await asyncio.wait_for(queue.get(), 1) == "k"
    queue.done("k")
    queue.forget("k")
    assert queue.num_requeues("k") == 0
    assert registry.get_sample_value("workqueue_retries_total", {"name": "q"}) == 1


async def test_shutdown_wakes_waiting_workers_and_drains_the_keys_in_flight() -> None:
    queue: WorkQueue[str] = WorkQueue("q")
    waiting = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0)
    queue.add("a")
    assert await waiting == "a"
    queue.add_after("b", 0.01)
    queue.shut_down()
    with pytest.raises(ShutDown):
        await queue.get()
    queue.add("c")  # ignored
    assert await queue.drain(0.01) is False  # "a" still in flight
    queue.done("a")
    assert await queue.drain(0.01) is True
    await asyncio.sleep(0.02)
    assert len(queue) == 0  # the delayed add was cancelled


async def test_controller_counts_retries_failures_and_drains_on_stop() -> None:
    registry = CollectorRegistry()
    calls: list[str] = []
    release = asyncio.Event()

    async def reconcile(key: str) -> Result:
        calls.append(key)
        if key == "bad" and calls.count("bad") == 1:
            raise RuntimeError("boom")
        if key == "slow":
            await release.wait()
        return Result()

    ctrl: Controller[str] = Controller(
        "test",
        reconcile,
        Options(
            metrics=RuntimeMetrics.of(registry),
            rate_limiter=ItemExponentialFailureRateLimiter(0.001, 0.01),
            workers=2,
        ),
    )
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    ctrl.enqueue("bad")
    for _ in range(200):
        if calls.count("bad") == 2:
            break
        await asyncio.sleep(0.01)
    assert calls.count("bad") == 2 and ctrl.queue.num_requeues("bad") == 0
    sample = registry.get_sample_value
    assert (
        sample("controller_runtime_reconcile_total", {"controller": "test", "result": "error"}) == 1
    )
    assert sample("controller_runtime_reconcile_errors_total", {"controller": "test"}) == 1
    ctrl.enqueue("slow")
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.sleep(0.01)
    assert not task.done()  # waits for the key in flight
    release.set()
    await asyncio.wait_for(task, 1)
    assert (
        sample("controller_runtime_reconcile_total", {"controller": "test", "result": "success"})
        == 2
    )


async def test_controller_cooldown_spaces_reruns_and_holds_events_during_backoff() -> None:
    outcomes = [False, True]
    seen: list[float] = []

    async def reconcile(key: str) -> Result:
        seen.append(asyncio.get_running_loop().time())
        return Result() if outcomes.pop(0) else Result("error", retry=True)

    ctrl: Controller[str] = Controller(
        "c",
        reconcile,
        Options(
            metrics=RuntimeMetrics.of(CollectorRegistry()),
            rate_limiter=ItemExponentialFailureRateLimiter(0.05, 0.1),
            cooldown=0.01,
        ),
    )
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    ctrl.enqueue("k")
    await asyncio.sleep(0.02)
    ctrl.enqueue("k")  # during the backoff (0.1 s): waits for it
    await asyncio.sleep(0.03)
    assert len(seen) == 1
    for _ in range(100):
        if len(seen) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(seen) == 2 and seen[1] - seen[0] >= 0.09
    stop.set()
    await asyncio.wait_for(task, 1)


class Probe(Runnable):
    """A runnable that records when it runs (the protocol's defaults answer the rest)."""

    def __init__(self, name: str, needs_leader: bool, crash: bool = False) -> None:
        self.name = name
        self.needs_leader = needs_leader
        self.running = False
        self.runs = 0
        self.leader: list[bool] = []
        self._crash = crash

    async def run(self, stop: asyncio.Event) -> None:
        self.running, self.runs = True, self.runs + 1
        try:
            if self._crash:
                raise RuntimeError(f"{self.name} crashed")
            await stop.wait()
        finally:
            self.running = False

    def leadership_changed(self, leader: bool) -> None:
        self.leader.append(leader)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met")


async def test_manager_runs_leader_gated_runnables_only_while_leading() -> None:
    leading = [False]
    always, gated = Probe("always", False), Probe("gated", True)
    manager = Manager([always, gated], lambda: leading[0])
    stop = asyncio.Event()
    task = asyncio.ensure_future(manager.run(stop))
    await _until(lambda: always.running)
    assert not gated.running
    leading[0] = True
    manager.leadership_changed(True)
    await _until(lambda: gated.running)
    leading[0] = False
    manager.leadership_changed(False)
    await _until(lambda: not gated.running)
    assert always.running and always.leader == gated.leader == [True, False]
    stop.set()
    assert await asyncio.wait_for(task, 1) == []
    assert not always.running and gated.runs == 1


async def test_manager_stops_everything_when_a_runnable_crashes() -> None:
    other = Probe("other", False)
    manager = Manager([other, Probe("crashy", False, crash=True)], lambda: True)
    crashed = await asyncio.wait_for(manager.run(asyncio.Event()), 1)
    assert [str(e) for e in crashed] == ["crashy crashed"] and not other.running


async def test_manager_start_returns_when_a_part_ends_before_every_part_started() -> None:
    """``Manager.start`` waits for the start of every part, or for the run's end: a
    server that cannot bind ends the run before the parts after it start."""
    order: list[str] = []
    crashy = Probe("crashy", False, crash=True)
    crashy.started = asyncio.Event()  # type: ignore[attr-defined]  # never set: it ends first
    manager = Manager([crashy, Started("after", order)], lambda: True)
    task = await asyncio.wait_for(manager.start(asyncio.Event()), 1)
    assert task.done() and not manager.started.is_set() and order == []
    assert [str(e) for e in task.result()] == ["crashy crashed"]


# --- every long-running part a Runnable (issue 21) ---

PACKAGE = Path(__file__).resolve().parent.parent / "shared_svc"


def _stop_loops(path: Path) -> list[int]:
    """Lines of ``while not <x>.is_set()`` loops (a hand-written long-running loop)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.While)
            and isinstance(node.test, ast.UnaryOp)
            and isinstance(node.test.op, ast.Not)
            and isinstance(node.test.operand, ast.Call)
            and isinstance(node.test.operand.func, ast.Attribute)
            and node.test.operand.func.attr == "is_set"
        ):
            found.append(node.lineno)
    return found


# The one loop helper (``wait.loop.repeat``, below kube/ and runtime/) and the runtime.
LOOP_HELPERS = {"runtime", "wait"}


def test_no_hand_written_stop_loop_lives_outside_the_runtime() -> None:
    loops = {
        str(p.relative_to(PACKAGE)): lines
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] not in LOOP_HELPERS and (lines := _stop_loops(p))
    }
    assert loops == {}, loops


def test_the_loop_finder_finds_a_stop_loop(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("async def f(stop):\n    while not stop.is_set():\n        pass\n")
    assert _stop_loops(sample) == [2]


def test_service_wires_every_long_running_part_as_a_runnable_of_its_manager() -> None:
    source = (PACKAGE / "service.py").read_text()
    tree = ast.parse(source)
    spawned = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("ensure_future", "create_task", "start", "setup")
    ]
    # Only the Manager is started by hand (``Manager.start``: until every part has started).
    assert sorted(ast.unparse(n) for n in spawned) == ["self.manager.start(stop)"]


async def test_periodic_runs_at_once_then_on_wake_and_stops_with_on_stop() -> None:
    wake, stop = asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    async def on_stop() -> None:
        calls.append("stopped")

    def step() -> None:
        calls.append("step")
        if len(calls) == 2:
            raise RuntimeError("a failure is logged, not fatal")

    part = Periodic("p", step, lambda: 3600.0, wake=wake, on_stop=on_stop)
    task = asyncio.ensure_future(part.run(stop))
    await _until(lambda: part.steps == 1)
    wake.set()
    await _until(lambda: part.steps == 2)
    wake.set()
    await _until(lambda: part.steps == 3)
    stop.set()
    await asyncio.wait_for(task, 1)
    assert calls == ["step", "step", "step", "stopped"]


class Started(Probe):
    def __init__(self, name: str, order: list[str]) -> None:
        super().__init__(name, False)
        self.started = asyncio.Event()
        self._order = order

    async def run(self, stop: asyncio.Event) -> None:
        self._order.append(f"start {self.name}")
        self.started.set()
        try:
            await stop.wait()
        finally:
            self._order.append(f"stop {self.name}")


async def test_manager_starts_in_order_and_stops_in_reverse_order() -> None:
    order: list[str] = []
    parts = [Started(n, order) for n in ("http", "lease", "controller")]
    manager = Manager(parts, lambda: True)
    stop = asyncio.Event()
    task = await asyncio.wait_for(manager.start(stop), 1)
    assert manager.started.is_set() and not task.done()
    assert order == ["start http", "start lease", "start controller"]
    stop.set()
    assert await asyncio.wait_for(task, 1) == []
    assert order == [
        "start http",
        "start lease",
        "start controller",
        "stop controller",
        "stop lease",
        "stop http",
    ]
    assert manager.stopped == ["controller", "lease", "http"]


async def test_a_periodic_part_stuck_in_one_step_is_not_alive() -> None:
    from shared_svc.runtime.controller import STALL_SECONDS

    entered, release = asyncio.Event(), asyncio.Event()

    async def stuck() -> None:
        entered.set()
        await release.wait()

    part = Periodic("p", stuck, lambda: 3600.0)
    stop = asyncio.Event()
    task = asyncio.ensure_future(part.run(stop))
    await asyncio.wait_for(entered.wait(), 1)
    assert part.alive()
    assert part._in_step_since is not None
    part._in_step_since -= STALL_SECONDS + 1  # as if the step had hung that long
    assert not part.alive()
    release.set()
    await _until(lambda: part.alive())
    stop.set()
    await asyncio.wait_for(task, 1)


# --- the caches are Runnables of the Manager (issue 21) ---


def test_a_part_says_only_what_differs_from_the_runnable_defaults() -> None:
    from shared_svc.http import HttpServer
    from shared_svc.kube.lease import LeaseElector

    class Bare(Runnable):
        name = "bare"

        async def run(self, stop: asyncio.Event) -> None:
            await stop.wait()

    bare = Bare()
    assert (bare.needs_leader, bare.ready(), bare.alive(), bare.status()) == (
        False,
        True,
        True,
        {},
    )
    assert bare.leadership_changed(True) is None
    # The HTTP server and the Lease (kube/, below the runtime) take them from the protocol.
    for part in (HttpServer, LeaseElector, Periodic):
        assert part.leadership_changed is Runnable.leadership_changed, part
    for part in (HttpServer, LeaseElector):  # a Periodic is ready once what it watches is
        assert part.ready is Runnable.ready, part


def test_each_declared_cache_is_one_runnable_ready_once_synced() -> None:
    from shared_svc.config import Config
    from shared_svc.controllers.services import caches
    from shared_svc.kube.registry import CacheRegistry, CacheRunnable

    registry = CacheRegistry(object())  # type: ignore[arg-type]  # caches made, not run
    declared = caches.declare(Config(upgrade_controller=True))
    first = registry.cache(declared["daemonsets"])
    second = registry.cache(declared["daemonsets"])
    registry.cache(declared["pods"])
    assert first is second
    runnables = registry.runnables()
    assert [type(r) for r in runnables] == [CacheRunnable, CacheRunnable]
    assert [r.name for r in runnables] == ["cache DaemonSet", "cache Pod in gpu-operator"]
    daemonsets = runnables[0]
    assert daemonsets.cache is first and not daemonsets.ready() and daemonsets.alive()
    first.synced.set()
    assert daemonsets.ready()
    # Once handed to their runner, a reader may still share a cache, not add one (it would
    # never run).
    assert registry.cache(declared["daemonsets"]) is first
    with pytest.raises(RuntimeError, match="cache Service in gpu-operator asked for after"):
        registry.cache(declared["services"])


async def test_a_cache_that_ends_unexpectedly_ends_the_manager_as_a_crash() -> None:
    from shared_svc.kube.registry import CacheRunnable
    from shared_svc.kube.resources import Resource

    class Ending:
        resource = Resource("", "v1", "pods", "Pod", namespace="ns")
        synced = asyncio.Event()

        async def run(self, stop: asyncio.Event) -> None:
            return None  # not asked to

    controller = Probe("controller", False)
    cache = CacheRunnable(Ending())  # type: ignore[arg-type]
    manager = Manager([cache, controller], lambda: True)
    crashed = await asyncio.wait_for(manager.run(asyncio.Event()), 1)
    assert [str(e) for e in crashed] == ["cache Pod in ns ended unexpectedly"]
    assert manager.stopped == ["controller", "cache Pod in ns"] and not controller.running


# --- issue 29: a controller declares what it reads; the runtime runs it ---


async def soon(condition: Callable[[], bool]) -> None:
    """Waits (bounded) until ``condition`` holds (``tests.kube.eventually``)."""

    async def check() -> bool:
        return condition()

    await eventually(check, timeout=5, interval=0.01)


def _watching(reconcile: Callable[[str], Any], **kw: Any) -> tuple[Controller[str], Any]:
    """A controller that watches one cache (made, never listed: filled here), each event
    keyed by the object's name."""
    from shared_svc.k8s.objects import name_of
    from shared_svc.kube.reflector import Cache
    from shared_svc.kube.resources import Resource

    cache = Cache(object(), Resource("", "v1", "services", "Service", namespace="ns"))  # type: ignore[arg-type]
    ctrl: Controller[str] = Controller(
        "watching",
        reconcile,
        Options(
            metrics=RuntimeMetrics.of(CollectorRegistry()),
            rate_limiter=ItemExponentialFailureRateLimiter(kw.pop("backoff", 0.001), 600.0),
            **kw,
        ),
    )
    ctrl.watch(cache, name_of)
    return ctrl, cache


def _service(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version}}


async def test_run_adds_the_handlers_and_waits_for_the_sync_then_reconciles_what_was_listed() -> (
    None
):
    """controller-runtime's Start: nothing is reconciled (nor polled for) while the watched
    cache has not listed; its list's adds are the first keys."""
    from testenv.caches import fill

    seen: list[str] = []

    async def reconcile(key: str) -> Result:
        seen.append(key)
        return Result()

    ctrl, cache = _watching(reconcile)
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    ctrl.enqueue("early")  # a key before the caches synced waits for them
    await asyncio.sleep(0.1)
    assert seen == [] and not ctrl.synced()
    fill(cache, [_service("a", "1"), _service("b", "2")])
    await soon(lambda: len(seen) == 3)
    assert sorted(seen) == ["a", "b", "early"] and ctrl.synced()
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_no_key_is_handed_out_while_a_watched_cache_re_lists() -> None:
    """With ``only_when_synced`` (the Services controller's: it plans from every cache)."""
    from testenv.caches import fill

    seen: list[str] = []

    async def reconcile(key: str) -> Result:
        seen.append(key)
        return Result()

    ctrl, cache = _watching(reconcile, only_when_synced=True)
    fill(cache, [])
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    await asyncio.sleep(0.05)
    cache.invalidate()  # the watch is lost: the cache must list again
    ctrl.enqueue("k")
    await asyncio.sleep(0.1)
    assert seen == []
    fill(cache, [])  # listed again
    await soon(lambda: seen)
    assert seen == ["k"]
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_re_list_retries_a_failed_key_at_once_a_change_waits_out_its_backoff() -> None:
    """The relists comparison the Services controller made, as events: a re-list hands out
    the objects it brings again unchanged (a replay), whose keys are retried now; a plain
    change of a failing key waits for its backoff."""
    from testenv.caches import deliver, fill

    failing = {"a": True}
    seen: list[str] = []

    async def reconcile(key: str) -> Result:
        seen.append(key)
        return Result("error", retry=True) if failing.get(key) else Result()

    ctrl, cache = _watching(reconcile, backoff=300.0, cooldown=0.01)
    fill(cache, [_service("a", "1")])
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    await soon(lambda: seen)
    assert seen == ["a"] and ctrl.failures("a") == 1  # backing off for 10 minutes
    deliver(cache, _service("a", "2"))  # a change: waits for the backoff
    await asyncio.sleep(0.1)
    assert seen == ["a"]
    failing["a"] = False
    fill(cache, [_service("a", "2")])  # the cache lists again: "a" is brought again as it was
    await soon(lambda: len(seen) == 2)
    assert seen == ["a", "a"] and ctrl.failures("a") == 0
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_the_resync_enqueues_every_key_it_is_given() -> None:
    from testenv.caches import fill

    seen: list[str] = []

    async def reconcile(key: str) -> Result:
        seen.append(key)
        return Result()

    ctrl, cache = _watching(reconcile)
    ctrl.resync(0.05, lambda: ["x", "y"])
    fill(cache, [])
    stop = asyncio.Event()
    task = asyncio.ensure_future(ctrl.run(stop))
    await soon(lambda: seen.count("x") >= 2)
    assert seen.count("x") >= 2 and seen.count("y") >= 2
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_switched_runs_its_part_only_while_on_and_puts_it_off_after() -> None:
    from shared_svc.runtime.manager import Switched

    on = [False]
    runs: list[str] = []

    class Part(Runnable):
        name = "part"

        async def run(self, stop: asyncio.Event) -> None:
            runs.append("start")
            await stop.wait()
            runs.append("stop")

    switched = Switched(Part(), lambda: on[0], when_off=lambda: runs.append("off"))
    stop = asyncio.Event()
    task = asyncio.ensure_future(switched.run(stop))
    await asyncio.sleep(0.05)
    assert runs == [] and switched.ready()
    on[0] = True
    switched.flip()
    await asyncio.sleep(0.05)
    assert runs == ["start"] and switched.running
    on[0] = False
    switched.flip()
    await asyncio.sleep(0.05)
    assert runs == ["start", "stop", "off"] and not switched.running
    on[0] = True
    switched.flip()
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert runs == ["start", "stop", "off", "start", "stop", "off"]


async def test_a_periodic_that_watches_a_cache_waits_for_its_sync_and_wakes_on_its_changes() -> (
    None
):
    from shared_svc.kube.reflector import Cache
    from shared_svc.kube.resources import Resource
    from testenv.caches import deliver, fill

    cache = Cache(object(), Resource("", "v1", "services", "Service", namespace="ns"))  # type: ignore[arg-type]
    steps: list[int] = []
    part = Periodic("p", lambda: steps.append(len(cache.items())), lambda: 3600.0)
    part.watch(cache)
    stop = asyncio.Event()
    task = asyncio.ensure_future(part.run(stop))
    await asyncio.sleep(0.05)
    assert steps == [] and not part.ready()
    fill(cache, [])
    await soon(lambda: steps)
    assert steps == [0]
    deliver(cache, _service("a", "1"))
    await soon(lambda: len(steps) == 2)
    assert steps == [0, 1]
    stop.set()
    await asyncio.wait_for(task, 5)
