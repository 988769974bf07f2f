"""Leader election through a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Written here rather than taken from ``kubernetes_asyncio.leaderelection`` because that
one cannot release the Lease on shutdown (a standby would then wait a whole lease
duration after every rolling update) and judges expiry by comparing wall clocks of
different machines. Here, as in client-go, a standby judges expiry by its own
monotonic clock: a record it has watched go unrenewed for ``lease_duration`` is free.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared_svc.aio import sleep_or_stop
from shared_svc.kube.writer import object_path, raw_request

log = logging.getLogger(__name__)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
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
        self.is_leader = False
        self.holder: str | None = None
        self.transitions = 0
        self._observed: tuple[str, str] | None = None  # (holder, renewTime)
        self._observed_at = 0.0
        self._last_renew = 0.0
        self.last_error: str | None = None

    def _set_leader(self, value: bool) -> None:
        if value != self.is_leader:
            self.is_leader = value
            log.info("leadership changed", extra={"leader": value, "identity": self.identity})
            if self._on_change:
                self._on_change(value)

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

    async def try_acquire_or_renew(self) -> bool:
        loop = asyncio.get_running_loop()
        path = object_path("Lease", self._ns, self._name)
        try:
            lease = await raw_request(self._api, "GET", path)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self._name, "namespace": self._ns},
                "spec": self._spec(transitions=0, acquire=True, old=None),
            }
            await raw_request(self._api, "POST", object_path("Lease", self._ns), body=body)
            self._last_renew = loop.time()
            self.holder = self.identity
            return True
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
        transitions = self.transitions if mine else self.transitions + 1
        lease["spec"] = self._spec(transitions=transitions, acquire=not mine, old=spec)
        updated = await raw_request(
            self._api, "PUT", path, body=lease
        )  # resourceVersion guards the race
        new_spec = updated.get("spec") or {}
        self._observed = (new_spec.get("holderIdentity") or "", new_spec.get("renewTime") or "")
        self._observed_at = self._last_renew = loop.time()
        self.holder = self.identity
        self.transitions = transitions
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Campaigns and renews until ``stop``; then releases the Lease if held."""
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                try:
                    ok = await self.try_acquire_or_renew()
                    self.last_error = None
                except Exception as exc:  # API trouble: keep trying; leadership lapses by deadline
                    ok = False
                    self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if ok:
                    self._set_leader(True)
                elif (self.is_leader and loop.time() - self._last_renew > self._renew_deadline) or (
                    self.is_leader and self.holder not in (None, self.identity)
                ):
                    self._set_leader(False)
                await sleep_or_stop(stop, self._retry)
        finally:
            await self.release()

    async def release(self) -> None:
        if not self.is_leader:
            return
        self._set_leader(False)
        path = object_path("Lease", self._ns, self._name)
        try:
            lease = await raw_request(self._api, "GET", path)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"].update(
                {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _now()}
            )
            await raw_request(self._api, "PUT", path, body=lease)
            log.info("lease released", extra={"identity": self.identity})
        except Exception as exc:  # best effort: the lease expires anyway
            log.warning("lease not released", extra={"error": str(exc)})
