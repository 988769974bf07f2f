"""What each Kubernetes version of the test control plane gets (issue 31), proven on that
version's API server: part of the compatibility suite (tests/compat.py), so ``make test`` runs
it on 1.33, 1.34, 1.35, 1.36 and 1.37 (``--kube-version``).

- The version in use is the one asked for: the API server's ``/version``, etcd's, and
  kube-controller-manager's.
- ``admission.mutation: auto`` renders, as ``helm install`` renders it on that server (its
  version and API versions: helmrender ``--kubeconfig``), the guard the README's
  compatibility table names for the version, and that guard holds there; a pre-v1
  MutatingAdmissionPolicy turned on by the cluster's owner changes nothing (on 1.34 and 1.35
  the beta: the webhook stays).
- No warning of the API server reaches shared-svc, and one on every answer changes nothing
  and is never logged; a ``trafficDistribution`` another manager sets costs no write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import testenv
from testenv import ControlPlane
from tests.admission import (
    ADMISSION_KINDS,
    SimulatedOperator,
    Tls,
    guard_docs,
    install,
    make_tls,
    uninstall,
    webhook_sets,
)
from tests.apiproxy import ThrottlingProxy, kubeconfig_via
from tests.kube import api_client, eventually, make_namespace, unique
from tests.svc import (
    Kube,
    apiserver_write_count,
    cp_body,
    gc_body,
    running,
    service_config,
    settle,
    successful_reconciles,
)
from tests.test_admission_guard import free_port, neutralised
from tests.test_deploy_chart import CHART, REPO, RenderError, render_docs

README = REPO / "README.md"
POLICY_KINDS = {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"}
GUARD_KINDS = {
    "policy": {*POLICY_KINDS, "ValidatingWebhookConfiguration"},
    "webhook": {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"},
}
# What a cluster's owner turns on to serve the MutatingAdmissionPolicy before v1: the alpha
# on 1.33 (gate and API off by default), the beta on 1.34-1.35 (the same, v1beta1), still
# served beside v1 on 1.36 and 1.37 when asked for.
PRE_V1_POLICY: dict[str, tuple[str, dict[str, str | None]]] = {
    "1.33": (
        "v1alpha1",
        {
            "--feature-gates": "MutatingAdmissionPolicy=true",
            "--runtime-config": "admissionregistration.k8s.io/v1alpha1=true",
        },
    ),
    "1.34": (
        "v1beta1",
        {
            "--feature-gates": "MutatingAdmissionPolicy=true",
            "--runtime-config": "admissionregistration.k8s.io/v1beta1=true",
        },
    ),
    "1.35": (
        "v1beta1",
        {
            "--feature-gates": "MutatingAdmissionPolicy=true",
            "--runtime-config": "admissionregistration.k8s.io/v1beta1=true",
        },
    ),
    "1.36": ("v1beta1", {"--runtime-config": "admissionregistration.k8s.io/v1beta1=true"}),
    "1.37": ("v1beta1", {"--runtime-config": "admissionregistration.k8s.io/v1beta1=true"}),
}


def minor() -> str:
    return testenv.kube_version()


def readme_row(release: str) -> list[str]:
    """The cells of the README's compatibility row that says the release was tested."""
    table = README.read_text().split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0].startswith("Kubernetes") and f" {release.lstrip('v')} with etcd " in cells[1]:
            return cells
    raise AssertionError(f"README's compatibility table has no row tested on {release}")


def readme_guard_mode(release: str) -> str:
    """The update guard the README says ``auto`` gives on ``release``: policy or webhook."""
    guard = readme_row(release)[2]
    if guard.startswith("update guard: `MutatingAdmissionPolicy`"):
        return "policy"
    if guard.startswith("update guard: mutating webhook"):
        return "webhook"
    raise AssertionError(f"README: {guard!r} names no update guard")


def kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    return make_tls(tmp_path_factory.mktemp("webhook-tls"))


# --- the version -----------------------------------------------------------------------


@pytest.mark.apiserver
def test_the_control_plane_runs_the_version_asked_for(control_plane: ControlPlane) -> None:
    asked = minor()
    release = testenv.kubernetes_release(asked)
    assert release.startswith(f"v{asked}.")
    assert control_plane.kube_version == asked
    assert control_plane.server_version() == release
    with urllib.request.urlopen(f"{control_plane.etcd_url}/version", timeout=10) as resp:
        etcd = json.loads(resp.read())
    assert f"v{etcd['etcdserver']}" == testenv.etcd_release(asked)
    kcm = testenv.build_binaries() / "kube-controller-manager"
    out = subprocess.run([str(kcm), "--version"], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["Kubernetes", release], out


def test_an_unknown_version_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testenv.KUBE_VERSION_ENV, "1.30")
    with pytest.raises(testenv.ControlPlaneError) as err:
        testenv.kube_version()
    assert str(err.value) == (
        "SHARED_SVC_KUBE_VERSION=1.30: not a Kubernetes version of the test control plane"
        " (one of 1.33, 1.34, 1.35, 1.36, 1.37)"
    )
    monkeypatch.delenv(testenv.KUBE_VERSION_ENV)
    assert testenv.kube_version() == testenv.DEFAULT_KUBE_VERSION == "1.36"


def test_the_chart_needs_the_oldest_version_tested() -> None:
    oldest = testenv.kube_versions()[0]
    assert re.search(rf'^kubeVersion: ">={oldest}\.0-0"$', (CHART / "Chart.yaml").read_text(), re.M)


@pytest.mark.helm
def test_helm_refuses_a_cluster_older_than_the_chart_and_takes_the_oldest_tested() -> None:
    oldest = testenv.kubernetes_release(testenv.kube_versions()[0])
    with pytest.raises(RenderError, match=r"chart requires kubeVersion >=1\.33\.0-0"):
        render_docs(flags=("--kube-version", "v1.32.9"))
    assert render_docs(flags=("--kube-version", oldest))


# --- the guard as helm install decides it --------------------------------------------


async def guard_holds(
    cp: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls, port: int, mode: str
) -> None:
    """With the chart's guard installed: shared-svc serving the webhooks, gpu-operator's
    PUTs change nothing (``neutralised``), and its delete of a Service a GPUCluster needs
    is answered 404."""
    owner = await kube.create_cr(cp_body())
    config = service_config(
        cp, kube.ns, webhook_cert_file=tls.cert_file, webhook_key_file=tls.key_file
    ).model_copy(update={"webhook_port": port})
    writer = await SimulatedOperator.start(cp, tmp_path, kube.ns, owner)
    try:
        async with running(config) as svc:
            await neutralised(kube, svc, writer, mode)
            assert svc.status()["admissionGuard"]["deleteGuard"] is True
            await kube.patch_cr(
                "ClusterPolicy", "cluster-policy", {"spec": {"dcgm": {"enabled": False}}}
            )
            await kube.create_cr(gc_body())
            await settle(svc)
            before = await kube.service("nvidia-dcgm")
            assert before is not None

            async def refused() -> bool:
                return await writer.delete("nvidia-dcgm", dry_run=True) == 404

            await eventually(refused, timeout=30)
            assert await writer.delete("nvidia-dcgm") == 404
            after = await kube.service("nvidia-dcgm")
            assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"]
    finally:
        await writer.close()


@pytest.mark.apiserver
async def test_auto_renders_and_installs_the_guard_the_readme_names_for_this_version(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, tls: Tls
) -> None:
    mode = readme_guard_mode(control_plane.server_version())
    port = free_port()
    docs = guard_docs(kube.ns, *webhook_sets(tls, port, mutation="auto"), cluster=control_plane)
    assert kinds(docs) == GUARD_KINDS[mode]
    # helm template, offline, knows no kinds: auto renders the webhook everywhere.
    offline = guard_docs(kube.ns, *webhook_sets(tls, port, mutation="auto"))
    assert kinds(offline) == GUARD_KINDS["webhook"]
    install(control_plane, docs)
    try:
        await guard_holds(control_plane, kube, tmp_path, tls, port, mode)
    finally:
        uninstall(control_plane, docs)


@contextlib.asynccontextmanager
async def own_plane(
    workdir: Path, flags: dict[str, str | None]
) -> AsyncIterator[tuple[ControlPlane, Kube]]:
    """A control plane of the test's own, with more kube-apiserver flags, and admin helpers
    in a namespace on it."""
    try:
        cp = await asyncio.to_thread(testenv.start, workdir, apiserver_flags=flags)
    except testenv.ControlPlaneError as exc:
        pytest.fail(f"control plane with {flags} did not start: {exc}", pytrace=False)
    try:
        api = await api_client(cp)
        try:
            yield cp, Kube(api, await make_namespace(api, unique("compat")))
        finally:
            await api.close()
    finally:
        cp.stop()


@pytest.mark.apiserver
async def test_a_pre_v1_policy_the_cluster_owner_turns_on_changes_nothing(
    tmp_path: Path, tls: Tls
) -> None:
    """auto takes the v1 kind only: with the version's alpha or beta MutatingAdmissionPolicy
    served too, it renders what the README says (the webhook where v1 is not served), and
    that guard holds."""
    version, flags = PRE_V1_POLICY[minor()]
    async with own_plane(tmp_path / "cp", flags) as (cp, kube):
        status, served = cp.request("GET", f"/apis/admissionregistration.k8s.io/{version}")
        assert status == 200, served
        assert "MutatingAdmissionPolicy" in {r["kind"] for r in served["resources"]}
        mode = readme_guard_mode(cp.server_version())
        port = free_port()
        docs = guard_docs(kube.ns, *webhook_sets(tls, port, mutation="auto"), cluster=cp)
        assert kinds(docs) == GUARD_KINDS[mode]
        assert {d["apiVersion"] for d in docs} == {"admissionregistration.k8s.io/v1"}
        install(cp, docs)
        await guard_holds(cp, kube, tmp_path, tls, port, mode)


def api_versions(*served: str) -> tuple[str, ...]:
    return tuple(f"--api-versions={v}" for v in served)


@pytest.mark.helm
@pytest.mark.parametrize("minor_", ["1.34", "1.35"])
def test_on_1_34_and_1_35_auto_keeps_the_webhook_though_the_beta_policy_is_on(
    minor_: str,
) -> None:
    """What helm install sees there with the beta turned on by the cluster's owner: the
    admissionregistration.k8s.io/v1 webhooks and the v1beta1 policy kinds, no v1 policy
    kind. auto renders the mutating webhook (docs/decisions.md), the guard the README names
    for the release the compatibility suite runs there; only the v1 kind would make it
    render the policy."""
    release = testenv.kubernetes_release(minor_)
    served = (
        "admissionregistration.k8s.io/v1",
        "admissionregistration.k8s.io/v1/MutatingWebhookConfiguration",
        "admissionregistration.k8s.io/v1/ValidatingWebhookConfiguration",
        "admissionregistration.k8s.io/v1beta1",
        "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy",
        "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicyBinding",
    )
    flags = ("--kube-version", release, *api_versions(*served))
    docs = render_docs(flags=flags)
    assert kinds(docs) & set(ADMISSION_KINDS) == GUARD_KINDS["webhook"]
    with_v1 = api_versions("admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
    assert (
        kinds(render_docs(flags=(*flags, *with_v1))) & set(ADMISSION_KINDS) == GUARD_KINDS["policy"]
    )
    assert readme_guard_mode(release) == "webhook"


# --- what a version needs ------------------------------------------------------------

INJECTED = '299 - "shared-svc test: a warning on every answer"'


def mentions(records: list[logging.LogRecord], text: str) -> list[str]:
    """The log records (message or extra fields) that mention ``text``."""
    out = []
    for record in records:
        line = json.dumps(record.__dict__, default=str)
        if text in line:
            out.append(line)
    return out


@pytest.mark.apiserver
async def test_no_warning_reaches_shared_svc_and_one_on_every_answer_changes_nothing(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From 1.33 every core/v1 Endpoints request gets a 299 deprecation warning: shared-svc
    makes none, and the API server warns it of nothing through a migration. A warning on
    every answer (injected by the proxy) is no error and no log line: the migration goes
    the same way."""
    caplog.set_level(logging.DEBUG)
    proxy = await ThrottlingProxy.start(control_plane)
    kubeconfig = kubeconfig_via(control_plane, proxy.url, tmp_path / "via-proxy")
    config = service_config(control_plane, kube.ns, upgrade_controller=True).model_copy(
        update={"kubeconfig": str(kubeconfig)}
    )
    try:
        async with running(config) as svc:
            await kube.create_cr(cp_body())
            await settle(svc)
            ips = {n: s["spec"]["clusterIP"] for n, s in (await kube.services()).items()}
            warned = list(proxy.warnings)
            proxy.add_warning = INJECTED
            await kube.create_cr(gc_body())
            await settle(svc)
            await kube.delete_cr("ClusterPolicy", "cluster-policy")
            await settle(svc)
            after = await kube.services()
            status = svc.status()
            warned += [w for w in proxy.warnings if w[2] != INJECTED]
    finally:
        await proxy.close()
    assert warned == []
    endpoints = [r for r in proxy.requests if "/endpoints" in r[1]]
    assert endpoints == [], "shared-svc never reads core/v1 Endpoints"
    assert set(after) == {
        "nvidia-dcgm",
        "nvidia-dcgm-exporter",
        "nvidia-dcgm-dra",
        "nvidia-dcgm-exporter-dra",
    }
    assert {n: after[n]["spec"]["clusterIP"] for n in ips} == ips
    assert status["pending"] == [] and status["contested"] == []
    assert mentions(caplog.records, "a warning on every answer") == []


def traffic_distribution(version: str) -> str:
    """A value the version accepts: PreferSameNode is GA from 1.35 (alpha, off, before)."""
    major, minor_ = (int(x) for x in version.split("."))
    return "PreferSameNode" if (major, minor_) >= (1, 35) else "PreferClose"


@pytest.mark.apiserver
async def test_a_traffic_distribution_another_manager_sets_is_kept_and_costs_no_write(
    control_plane: ControlPlane, kube: Kube
) -> None:
    """``spec.trafficDistribution`` (its values grow with the version) is not shared-svc's:
    set by a platform team's apply on a Service shared-svc manages, it stays, and many
    reconciles write nothing (no diff loop)."""
    value = traffic_distribution(minor())
    await kube.create_cr(cp_body())
    async with running(service_config(control_plane, kube.ns, resync_seconds=0.25)) as svc:
        await settle(svc)
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "nvidia-dcgm", "namespace": kube.ns},
            "spec": {"trafficDistribution": value},
        }
        path = f"/api/v1/namespaces/{kube.ns}/services/nvidia-dcgm?fieldManager=platform-team"
        status, out = control_plane.request(
            "PATCH", path, json.dumps(body), content_type="application/apply-patch+yaml"
        )
        assert status == 200, out
        assert out["spec"]["trafficDistribution"] == value
        await settle(svc)
        before = apiserver_write_count(control_plane, ("services",))
        reconciles = successful_reconciles(svc)
        await eventually(
            lambda: asyncio.sleep(0, successful_reconciles(svc) >= reconciles + 8), timeout=30
        )
        await settle(svc)
        assert apiserver_write_count(control_plane, ("services",)) == before
        live = await kube.service("nvidia-dcgm")
        assert live is not None and live["spec"]["trafficDistribution"] == value
