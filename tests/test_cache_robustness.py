"""The caches (``kube.reflector.Cache``) on the real API server under hostile input and
faults: a CR nested deeper than Python's parser goes, a watch that goes silent, API
server restarts, and sustained 429 answers."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import testenv
from shared_svc.kube.reflector import Cache, Resource
from shared_svc.kube.untrusted import MAX_DEPTH, PRUNED, json_depth, loads
from testenv import ControlPlane
from tests.apiproxy import TcpProxy, ThrottlingProxy, kubeconfig_via
from tests.kube import api_client, eventually, make_namespace
from tests.svc import Kube, cp_body, running, service_config, settle

CACHE_LOGGER = "shared_svc.kube.reflector"


def nested_json(levels: int) -> str:
    """``{"n": {"n": ... {"leaf": true} ...}}``, built as text: json.dumps cannot nest this deep."""
    return '{"n":' * levels + '{"leaf":true}' + "}" * levels


def raw_patch(cp: ControlPlane, path: str, body: str) -> int:
    """A merge patch sent as raw text; only the status is read (the answer nests too deep
    for a JSON parser)."""
    req = urllib.request.Request(cp.url + path, data=body.encode(), method="PATCH")
    req.add_header("Authorization", f"Bearer {cp.admin_token}")
    req.add_header("Content-Type", "application/merge-patch+json")
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            resp.read()
            status: int = resp.status
            return status
    except urllib.error.HTTPError as err:
        return err.code


# --- pure: the parser ---
def test_loads_prunes_only_what_is_too_deep() -> None:
    deep = nested_json(1200)
    obj = '{"metadata":{"name":"cp"},"spec":{"dcgm":{"enabled":true,"x":' + deep + '}},"s":"}}]]"}'
    listing = ('{"items":[' + obj + ',{"metadata":{"name":"plain"}}]}').encode()
    with pytest.raises(RecursionError):
        json.loads(listing)
    data, pruned = loads(listing, envelope=2)
    assert pruned
    cp, plain = data["items"]
    assert cp["spec"]["dcgm"]["enabled"] is True and cp["s"] == "}}]]"
    assert plain == {"metadata": {"name": "plain"}}
    # Exactly MAX_DEPTH levels kept in the object, the rest replaced by the marker.
    assert json_depth(json.dumps(cp).encode()) == MAX_DEPTH
    assert PRUNED in json.dumps(cp)
    # A watch event carries the same object: the same result.
    event, _ = loads(('{"type":"MODIFIED","object":' + obj + "}").encode(), envelope=1)
    assert event["object"] == cp
    # Brackets inside strings are not nesting; ordinary objects are untouched.
    text = json.dumps({"a": "[" * 500, "b": [{"c": "}" * 500}]}).encode()
    assert loads(text) == (json.loads(text), False)
    fine = nested_json(MAX_DEPTH - 1).encode()
    assert loads(fine) == (json.loads(fine), False)


pytestmark = pytest.mark.apiserver


async def _true(value: bool) -> bool:
    return value


# --- 8: one deeply nested CR ---
async def test_a_deeply_nested_cr_neither_stops_the_cache_nor_loses_services(
    control_plane: ControlPlane, kube: Kube, caplog: pytest.LogCaptureFixture
) -> None:
    await kube.create_cr(cp_body())
    path = "/apis/nvidia.com/v1/clusterpolicies/cluster-policy"
    try:
        await _deep_cr_scenario(control_plane, kube, path, caplog)
    finally:  # the kube fixture's clean-up reads CRs with a recursive parser
        assert raw_patch(control_plane, path, '{"spec":{"dcgm":{"extra":null}}}') == 200


async def _deep_cr_scenario(
    control_plane: ControlPlane, kube: Kube, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        async with running(service_config(control_plane, kube.ns)) as svc:
            await settle(svc)
            before = {n: s["metadata"]["uid"] for n, s in (await kube.services()).items()}
            assert set(before) == {"nvidia-dcgm", "nvidia-dcgm-exporter"}
            # An unknown field under a block with x-kubernetes-preserve-unknown-fields.
            patch = '{"spec":{"dcgm":{"extra":' + nested_json(1200) + "}}}"
            assert raw_patch(control_plane, path, patch) == 200
            ctrl = svc.controller
            assert ctrl is not None
            cache = ctrl.caches["clusterpolicies"]
            # Known fields still count: disabling the exporter is acted on.
            assert (
                raw_patch(control_plane, path, '{"spec":{"dcgmExporter":{"enabled":false}}}') == 200
            )
            await eventually(lambda: _absent(kube, "nvidia-dcgm-exporter"), timeout=30)
            await settle(svc)
            assert svc.ready()
            assert cache.synced.is_set() and cache.last_error is None
            assert cache.pruned == {("", "cluster-policy")}
            [cached] = cache.items()
            assert cached["spec"]["dcgm"]["extra"]["n"]["n"]  # the shallow part is kept
            assert PRUNED in json.dumps(cached)
        # A fresh start lists it (the list path): synced, the Service is kept.
        async with running(service_config(control_plane, kube.ns)) as svc:
            await settle(svc)
            assert svc.ready()
            after = {n: s["metadata"]["uid"] for n, s in (await kube.services()).items()}
            assert after == {"nvidia-dcgm": before["nvidia-dcgm"]}
    cut = [r for r in caplog.records if "nested too deep" in r.getMessage()]
    assert cut and cut[0].__dict__["object"] == "cluster-policy"


async def _absent(kube: Kube, name: str) -> bool:
    return await kube.service(name) is None


# --- 10: a watch that goes silent, and API server restarts ---
def names(cache: Cache) -> set[str]:
    return {o["metadata"]["name"] for o in cache.items()}


def labels_of(cache: Cache, name: str) -> dict[str, str]:
    for o in cache.items():
        if o["metadata"]["name"] == name:
            labels: dict[str, str] = o["metadata"].get("labels") or {}
            return labels
    return {}


async def test_a_silent_watch_is_noticed_and_relisted(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    """The watch's connection stays open but carries nothing more (a peer gone without a
    FIN, a server that stopped delivering): no event, no bookmark. The cache must notice
    the silence, re-list and see the change made meanwhile."""
    proxy = await TcpProxy.start(control_plane)
    api = await api_client(
        control_plane, str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc"))
    )
    cache = Cache(
        api,
        Resource("", "v1", "services", "Service", namespace=kube.ns),
        idle_timeout_seconds=3.0,
    )
    stop = asyncio.Event()
    task = asyncio.ensure_future(cache.run(stop))
    try:
        await eventually(lambda: _true(cache.synced.is_set()), timeout=15)
        await kube.core.create_namespaced_service(
            kube.ns, {"metadata": {"name": "first"}, "spec": {"ports": [{"port": 1}]}}
        )
        await eventually(lambda: _true(names(cache) == {"first"}), timeout=15)
        assert proxy.blackhole() >= 1
        await kube.core.create_namespaced_service(
            kube.ns, {"metadata": {"name": "second"}, "spec": {"ports": [{"port": 1}]}}
        )
        await eventually(lambda: _true(names(cache) == {"first", "second"}), timeout=30)
        assert cache.idle_watches >= 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 70)
        await api.close()
        await proxy.close()


async def test_a_quiet_healthy_watch_is_not_taken_for_dead(kube: Kube) -> None:
    """No change for several watch timeouts: each watch ends at the server's timeout and the
    next one resumes from the resourceVersion the cache has; the silence detector (default:
    the watch timeout plus a margin) never fires, so a quiet namespace costs no re-list, and
    a change made after all those resumed watches is still seen, without a re-list."""
    cache = Cache(
        kube.api,
        Resource("", "v1", "services", "Service", namespace=kube.ns),
        watch_timeout_seconds=2,
    )
    stop = asyncio.Event()
    task = asyncio.ensure_future(cache.run(stop))
    try:
        await eventually(lambda: _true(cache.synced.is_set()), timeout=15)
        await asyncio.sleep(25)
        assert (cache.idle_watches, cache.relists, cache.last_error) == (0, 1, None)
        await kube.core.create_namespaced_service(
            kube.ns, {"metadata": {"name": "later"}, "spec": {"ports": [{"port": 1}]}}
        )
        await eventually(lambda: _true(names(cache) == {"later"}), timeout=15)
        assert (cache.idle_watches, cache.relists, cache.last_error) == (0, 1, None)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_every_cache_sees_changes_after_each_api_server_restart() -> None:
    """Own control plane, restarted six times under a running service; after each restart a
    change to a Service, to a ClusterPolicy and to a pod reaches every cache."""
    loop = asyncio.get_running_loop()
    cp = await loop.run_in_executor(None, testenv.start)
    try:
        admin = await api_client(cp)
        k = Kube(admin, await make_namespace(admin, "restarts"))
        await k.create_cr(cp_body())
        await k.core.create_namespaced_service(
            k.ns, {"metadata": {"name": "other"}, "spec": {"ports": [{"port": 1}]}}
        )
        await k.pod("dcgm-0", "nvidia-dcgm", common=False)
        config = service_config(cp, k.ns, leader_election=True, backoff_max_seconds=1.0)
        async with running(config) as svc:
            await settle(svc)
            ctrl = svc.controller
            assert ctrl is not None
            caches = ctrl.caches
            for round_ in range(6):
                await loop.run_in_executor(None, cp.stop_apiserver)
                await loop.run_in_executor(None, cp.start_apiserver)
                await admin.close()
                admin = await api_client(cp)
                k = Kube(admin, k.ns)
                mark = {"round": str(round_)}
                await k.patch_cr("ClusterPolicy", "cluster-policy", {"metadata": {"labels": mark}})
                await k.core.patch_namespaced_service("other", k.ns, {"metadata": {"labels": mark}})
                await k.core.patch_namespaced_pod("dcgm-0", k.ns, {"metadata": {"labels": mark}})
                for resource, name in (
                    ("clusterpolicies", "cluster-policy"),
                    ("services", "other"),
                    ("pods", "dcgm-0"),
                ):
                    cache = caches[resource]

                    async def seen(
                        i: Cache = cache, n: str = name, want: str = str(round_)
                    ) -> bool:
                        return labels_of(i, n).get("round") == want and i.synced.is_set()

                    await eventually(seen, timeout=30)
                await eventually(lambda: _true(ctrl.caches_synced() and svc.is_leader()), 30)
        await admin.close()
    finally:
        cp.stop()


# --- 11: sustained 429 ---
async def test_429_on_watches_keeps_the_caches_synced_and_the_service_ready(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every watch request answered 429 with Retry-After (an API server at its in-flight
    limit): the caches keep what they have, stay synced, the service stays ready and
    leading; once the server accepts watches again, changes flow."""
    await kube.create_cr(cp_body())
    proxy = await ThrottlingProxy.start(control_plane)
    config = service_config(
        control_plane,
        kube.ns,
        kubeconfig=str(kubeconfig_via(control_plane, proxy.url, tmp_path / "kc")),
        leader_election=True,
        lease_duration_seconds=6.0,
        renew_deadline_seconds=4.0,
        retry_period_seconds=0.5,
    )
    try:
        with caplog.at_level(logging.INFO, logger=CACHE_LOGGER):
            async with running(config) as svc:
                await settle(svc)
                await eventually(lambda: _true(svc.is_leader()), timeout=15)
                proxy.throttle()
                start = proxy.throttled
                unready = 0

                async def throttled_a_while() -> bool:
                    nonlocal unready
                    unready += not svc.ready()
                    return proxy.throttled >= start + 30

                await eventually(throttled_a_while, timeout=60, interval=0.05)
                assert unready == 0, f"not ready in {unready} samples"
                assert svc.is_leader()
                ctrl = svc.controller
                assert ctrl is not None
                assert all(i.synced.is_set() for i in ctrl.caches.values())
                assert any(i.throttled for i in ctrl.caches.values())
                proxy.throttle_watches = False
                await kube.patch_cr(
                    "ClusterPolicy",
                    "cluster-policy",
                    {"spec": {"dcgmExporter": {"enabled": False}}},
                )
                await eventually(lambda: _absent(kube, "nvidia-dcgm-exporter"), timeout=30)
    finally:
        await proxy.close()
    slow = [r for r in caplog.records if "slow down" in r.getMessage()]
    assert slow, "the throttling is logged"
    assert len(slow) < proxy.throttled, "logged when it starts, not on every 429"
