"""Leader election through a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Written here rather than taken from ``kubernetes_asyncio.leaderelection`` because that
one cannot release the Lease on shutdown (a standby would then wait a whole lease
duration after every rolling update) and judges expiry by comparing wall clocks of
different machines. Here, as in client-go, a standby judges expiry by its own
monotonic clock: a record it has watched go unrenewed for ``lease_duration`` is free.

A deleted Lease is not free at once: a standby that watched another renew it waits out
that record's lease duration before creating it again (client-go creates it at once, and
its old leader leads on beside the new one until its next renewal). The old leader, at
its next renewal, creates it again itself.

As in client-go, a leader that has not renewed within ``renew_deadline`` (counted from
when its last successful renewal was sent) gives up leadership, even while a request
hangs: every Lease request is cut at the time left before that deadline. Since
``renew_deadline < lease_duration``, it stops writing before any standby can take over.

Lease errors (API server unreachable, 403, timeouts) are counted on every attempt
(``on_error``), logged when they change, and kept in ``last_error`` for ``/status``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.kube.writer import describe_error, object_path, raw_request
from shared_svc.wait.loop import repeat
from shared_svc.wait.runnable import Runnable

log = logging.getLogger(__name__)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector(Runnable):
    def __init__(
        self,
        api: ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_change: Callable[[bool], None] | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period:
            raise ValueError("need lease duration > renew deadline > retry period")
        self._api = api
        self._ns = namespace
        self._name = name
        self.identity = identity
        self._duration = lease_duration
        self._renew_deadline = renew_deadline
        self._retry = retry_period
        self._on_change = on_change
        self._on_error = on_error
        self.is_leader = False
        self.holder: str | None = None
        self.transitions = 0
        self._observed: tuple[str, str] | None = None  # (holder, renewTime)
        self._observed_at = 0.0
        self._last_renew = 0.0  # when the last successful renewal was sent (monotonic)
        self.last_error: str | None = None
        self.errors = 0
        self._lease: dict[str, Any] | None = None  # the Lease as we last wrote or read it

    def _set_leader(self, value: bool) -> None:
        if value != self.is_leader:
            self.is_leader = value
            log.info("leadership changed", extra={"leader": value, "identity": self.identity})
            if self._on_change:
                self._on_change(value)

    def _lose(self, why: str) -> None:
        log.warning("leadership given up", extra={"identity": self.identity, "reason": why})
        self._set_leader(False)

    def _spec(
        self, *, transitions: int, acquire: bool, old: dict[str, Any] | None
    ) -> dict[str, Any]:
        now = _now()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self._duration)),
            "renewTime": now,
            "acquireTime": now if acquire else (old or {}).get("acquireTime", now),
            "leaseTransitions": transitions,
        }
        return spec

    def _record(self, error: str | None) -> None:
        """Counts every failed attempt; logs only when the error changes (or clears)."""
        if error is not None:
            self.errors += 1
            if self._on_error:
                self._on_error(error)
        if error != self.last_error:
            where = f"{self._ns}/{self._name}"
            if error is not None:
                log.warning(
                    "lease request failed",
                    extra={"lease": where, "error": error, "leader": self.is_leader},
                )
            else:
                log.info("lease requests succeed again", extra={"lease": where})
        self.last_error = error

    async def try_acquire_or_renew(self, timeout: float = 30.0) -> bool:
        """One attempt; each request is cut after ``timeout`` seconds.

        As client-go's leaderelection: while the record we last wrote (or read) is ours,
        it is renewed with one PUT carrying the resourceVersion we last saw, no GET. A
        409 Conflict (someone wrote the Lease since) or 404 (it was deleted) drops that
        cached record and the attempt goes on as a first one: GET, then PUT or POST.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        path = object_path("Lease", self._ns, self._name)
        cached = self._lease
        if cached is not None and (cached.get("spec") or {}).get("holderIdentity") == (
            self.identity
        ):
            try:
                return await self._put(cached, mine=True, started=started, timeout=timeout)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                self._lease = None
                log.debug("the Lease changed since we wrote it: reading it again")
        try:
            lease = await raw_request(self._api, "GET", path, timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            if self._other_fresh(loop.time()):
                # Deleted under a leader we watched renew: it may still lead (it learns at
                # its next renewal, and creates the Lease again). Free only once the record
                # we saw would have expired, as if it were still there.
                return False
            if await self._create(started, timeout):
                return True
            # Another created it between our GET and POST (a deleted Lease: every replica
            # races to create it): theirs is read and judged like any other, so a leader
            # that lost the race steps down now, not at its renew deadline.
            lease = await raw_request(self._api, "GET", path, timeout=timeout)
        self._lease = lease
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        if record != self._observed:
            self._observed = record
            self._observed_at = loop.time()
        self.holder = holder or None
        self.transitions = spec.get("leaseTransitions") or 0
        duration = float(spec.get("leaseDurationSeconds") or self._duration)
        mine = holder == self.identity
        expired = not holder or loop.time() - self._observed_at > duration
        if not mine and not expired:
            return False
        return await self._put(lease, mine=mine, started=started, timeout=timeout)

    def _other_fresh(self, now: float) -> bool:
        """The last record we saw was another's, seen less than a lease duration ago."""
        holder = self._observed[0] if self._observed else ""
        return (
            bool(holder) and holder != self.identity and now - self._observed_at <= self._duration
        )

    async def _create(self, started: float, timeout: float) -> bool:
        """POSTs a Lease with our record; False when one exists already (409)."""
        self._lease = None
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self._name, "namespace": self._ns},
            "spec": self._spec(transitions=0, acquire=True, old=None),
        }
        try:
            created = await raw_request(
                self._api, "POST", object_path("Lease", self._ns), body=body, timeout=timeout
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False
        self._lease = created if isinstance(created, dict) else None
        self._last_renew = started
        self.holder = self.identity
        return True

    async def _put(
        self, lease: dict[str, Any], *, mine: bool, started: float, timeout: float
    ) -> bool:
        """Writes our record over ``lease``; its resourceVersion guards the race."""
        spec = lease.get("spec") or {}
        transitions = (spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        body = {**lease, "spec": self._spec(transitions=transitions, acquire=not mine, old=spec)}
        path = object_path("Lease", self._ns, self._name)
        updated = await raw_request(self._api, "PUT", path, body=body, timeout=timeout)
        self._lease = updated if isinstance(updated, dict) else None
        new_spec = (updated or {}).get("spec") or {}
        self._observed = (new_spec.get("holderIdentity") or "", new_spec.get("renewTime") or "")
        self._observed_at = asyncio.get_running_loop().time()
        self._last_renew = started
        self.holder = self.identity
        self.transitions = transitions
        return True

    # --- the Runnable (wait.runnable; the protocol's defaults answer the rest): started
    # right after the HTTP server, stopped (released) after everything that writes ---
    name = "lease"

    async def run(self, stop: asyncio.Event) -> None:
        """Campaigns and renews until ``stop``; then releases the Lease if held."""
        try:
            await repeat(stop, self.step, lambda: self._retry, name="lease")
        finally:
            await self.release()

    async def step(self) -> None:
        """One attempt to acquire or renew, and what it means for leadership."""
        loop = asyncio.get_running_loop()
        # A leader has until its renew deadline; a candidate gets as long per attempt.
        budget = (
            self._last_renew + self._renew_deadline - loop.time()
            if self.is_leader
            else self._renew_deadline
        )
        ok = False
        if budget > 0:
            try:
                ok = await asyncio.wait_for(self.try_acquire_or_renew(budget), budget)
                self._record(None)
            except asyncio.CancelledError:
                raise
            except TimeoutError:  # a request hung past the deadline: cut, not awaited
                self._record(f"TimeoutError: no answer within {self._renew_deadline:g}s")
            except Exception as exc:  # API trouble: keep trying until the deadline
                self._record(describe_error(exc))
        if ok:
            self._set_leader(True)
        elif self.is_leader:
            if self.holder not in (None, self.identity):
                self._lose(f"the Lease is held by {self.holder}")
            elif budget <= 0 or loop.time() >= self._last_renew + self._renew_deadline:
                self._lose(f"not renewed within the renew deadline ({self._renew_deadline:g}s)")

    async def release(self) -> None:
        if not self.is_leader:
            return
        self._set_leader(False)
        self._lease = None
        path = object_path("Lease", self._ns, self._name)
        timeout = self._renew_deadline  # best effort, bounded: shutdown must not hang on it
        try:
            lease = await raw_request(self._api, "GET", path, timeout=timeout)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"].update(
                {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _now()}
            )
            await raw_request(self._api, "PUT", path, body=lease, timeout=timeout)
            log.info("lease released", extra={"identity": self.identity})
        except Exception as exc:  # best effort: the lease expires anyway
            log.warning("lease not released", extra={"error": str(exc)})
