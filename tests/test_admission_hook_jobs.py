"""The chart's certificate and uninstall Jobs on the real API server (issue 9 item 3):
``shared-svc admission certs`` and ``admission remove`` run with the arguments the chart
renders, as the hook Jobs' own ServiceAccounts holding exactly the chart's RBAC; the
webhook then serves with the generated certificate and the API server trusts it. And
shared-svc's own ServiceAccount cannot write admission configurations."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testenv import ControlPlane
from tests.admission import ADMISSION_API, guard_docs, install
from tests.kube import eventually
from tests.svc import Kube, cp_body, gc_body, running, service_config, settle
from tests.test_admission_guard import free_port, guard, operator
from tests.test_deploy_chart import Doc, render_docs
from tests.test_deploy_rbac import install_identity, remove_cluster_objects

pytestmark = pytest.mark.apiserver

RBAC = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
CONFIGS = {
    "mutating": "mutatingwebhookconfigurations",
    "validating": "validatingwebhookconfigurations",
}


def hook_job(docs: list[Doc], events: str) -> Doc:
    (job,) = [
        d
        for d in docs
        if d["kind"] == "Job" and d["metadata"]["annotations"]["helm.sh/hook"] == events
    ]
    return job


def hook_identity(cp: ControlPlane, docs: list[Doc], job: Doc, directory: Path) -> Path:
    """Applies the RBAC objects of the Job's ServiceAccount (the chart's, as rendered) and
    returns a kubeconfig holding a real token of it."""
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = job["metadata"]["namespace"]
    cp.apply_manifests(
        d for d in docs if d["kind"] in RBAC and d["metadata"]["name"].startswith(account)
    )
    token = cp.service_account_token(namespace, account)
    return cp.write_kubeconfig(directory / f"{account}.kubeconfig", token)


def remove_hook_cluster_objects(cp: ControlPlane, docs: list[Doc]) -> None:
    for d in docs:
        if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            plural = "clusterroles" if d["kind"] == "ClusterRole" else "clusterrolebindings"
            cp.request(
                "DELETE", f"/apis/rbac.authorization.k8s.io/v1/{plural}/{d['metadata']['name']}"
            )


async def run_job(job: Doc, kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """The Job's container: the same arguments, this checkout's shared-svc."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = [sys.executable, "-m", "shared_svc", *container["args"], "--kubeconfig", str(kubeconfig)]

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)

    # RBAC reaches the authorizer through informers: a fresh grant may take a moment
    for _ in range(50):
        done = await asyncio.to_thread(run)
        if done.returncode == 0 or "403" not in done.stderr:
            return done
        await asyncio.sleep(0.2)
    return done


def get(cp: ControlPlane, path: str) -> dict[str, Any] | None:
    status, body = cp.request("GET", path)
    assert status in (200, 404), (status, body)
    return body if status == 200 else None


async def test_certificate_jobs_create_keep_patch_and_the_api_server_trusts_the_webhook(
    control_plane: ControlPlane, kube: Kube, tmp_path: Path
) -> None:
    cp, ns = control_plane, kube.ns
    port = free_port()
    sets = ("admission.mutation=webhook", f"admission.webhook.url=https://127.0.0.1:{port}")
    docs = render_docs(*sets, name="shared-svc", namespace=ns)
    pre, post = (
        hook_job(docs, "pre-install,pre-upgrade"),
        hook_job(docs, "post-install,post-upgrade"),
    )
    guard_name = f"shared-svc-{ns}-guard"
    secret_path = f"/api/v1/namespaces/{ns}/secrets/shared-svc-webhook-tls"
    config_paths = {k: f"{ADMISSION_API}/{plural}/{guard_name}" for k, plural in CONFIGS.items()}
    kubeconfig = hook_identity(cp, docs, pre, tmp_path)
    try:
        # Before install: the Secret is made; the configurations do not exist yet.
        first = await run_job(pre, kubeconfig)
        assert first.returncode == 0, first.stderr
        assert f"secret {ns}/shared-svc-webhook-tls: created" in first.stdout
        assert "not installed, skipped" in first.stdout
        secret = get(cp, secret_path)
        assert secret and secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}

        async with guard(cp, guard_docs(ns, *sets)):
            # After install: the Secret is kept, the caBundle of both configurations set.
            second = await run_job(post, kubeconfig)
            assert second.returncode == 0, second.stderr
            assert "kept (valid until" in second.stdout
            kept = get(cp, secret_path)
            assert (
                kept
                and kept["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
            )
            configs = {k: get(cp, p) for k, p in config_paths.items()}
            for config in configs.values():
                assert (
                    config
                    and config["webhooks"][0]["clientConfig"]["caBundle"]
                    == secret["data"]["ca.crt"]
                )
            # An upgrade's Jobs change nothing: same Secret, same configurations.
            for job in (pre, post):
                again = await run_job(job, kubeconfig)
                assert again.returncode == 0 and "caBundle current" in again.stdout, again.stdout
            for kind, path in config_paths.items():
                now = get(cp, path)
                assert (
                    now
                    and now["metadata"]["resourceVersion"]
                    == configs[kind]["metadata"]["resourceVersion"]
                )  # type: ignore[index]

            # A re-apply of the rendered configurations (an upgrade, a GitOps sync with
            # server-side apply) keeps the caBundle: the chart does not render the field.
            install(cp, guard_docs(ns, *sets))
            for path in config_paths.values():
                now = get(cp, path)
                assert (
                    now
                    and now["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
                )

            # The Job's identity: our configurations and Secret only.
            token = cp.service_account_token(ns, "shared-svc-certs")
            other = {"metadata": {"name": f"other-{ns}"}, "webhooks": []}
            assert (
                cp.request("POST", f"{ADMISSION_API}/validatingwebhookconfigurations", other)[0]
                == 201
            )
            try:
                patch = [{"op": "add", "path": "/metadata/labels", "value": {"x": "y"}}]
                for path, code in (
                    (f"{ADMISSION_API}/validatingwebhookconfigurations/other-{ns}", 403),
                    (config_paths["validating"], 200),
                ):
                    status, _ = cp.request(
                        "PATCH",
                        path,
                        patch,
                        token=token,
                        content_type="application/json-patch+json",
                    )
                    assert status == code, path
                assert cp.request("DELETE", config_paths["validating"], token=token)[0] == 403
                assert (
                    cp.request("GET", f"/api/v1/namespaces/{ns}/secrets/other", token=token)[0]
                    == 403
                )
                assert (
                    cp.request(
                        "GET",
                        "/api/v1/namespaces/default/secrets/shared-svc-webhook-tls",
                        token=token,
                    )[0]
                    == 403
                )
            finally:
                cp.request("DELETE", f"{ADMISSION_API}/validatingwebhookconfigurations/other-{ns}")

            # The webhook serves with the generated pair, reached by URL: the API server
            # trusts it (the caBundle the Job wrote) and gets the guard's 404.
            raw = {k: base64.b64decode(v) for k, v in secret["data"].items()}
            (tmp_path / "tls.crt").write_bytes(raw["tls.crt"])
            (tmp_path / "tls.key").write_bytes(raw["tls.key"])
            owner = await kube.create_cr(cp_body(dcgm={"enabled": False}))
            await kube.create_cr(gc_body())
            config = service_config(
                cp,
                ns,
                webhook_cert_file=str(tmp_path / "tls.crt"),
                webhook_key_file=str(tmp_path / "tls.key"),
                webhook_port=port,
            )
            async with running(config) as svc, operator(cp, kube, tmp_path, owner) as writer:
                await settle(svc)

                async def refused() -> bool:
                    return await writer.delete("nvidia-dcgm", dry_run=True) == 404

                await eventually(refused, timeout=30)
                assert await kube.service("nvidia-dcgm") is not None

            # Uninstall: the pre-delete Job removes the configurations and the Secret, as
            # its own identity, which may delete nothing else.
            remove = hook_job(docs, "pre-delete")
            remove_config = hook_identity(cp, docs, remove, tmp_path)
            done = await run_job(remove, remove_config)
            assert done.returncode == 0, done.stderr
            for path in (*config_paths.values(), secret_path):
                assert get(cp, path) is None, path
            remover = cp.service_account_token(ns, "shared-svc-guard-remove")
            assert (
                cp.request("POST", f"{ADMISSION_API}/validatingwebhookconfigurations", other)[0]
                == 201
            )
            try:
                path = f"{ADMISSION_API}/validatingwebhookconfigurations/other-{ns}"
                assert cp.request("DELETE", path, token=remover)[0] == 403
            finally:
                cp.request("DELETE", f"{ADMISSION_API}/validatingwebhookconfigurations/other-{ns}")
            again = await run_job(remove, remove_config)
            assert again.returncode == 0 and "already gone" in again.stdout
    finally:
        remove_hook_cluster_objects(cp, docs)


async def test_shared_svc_cannot_write_admission_configurations(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = control_plane
    identity = install_identity(cp, tmp_path)
    try:
        token = cp.service_account_token(identity.namespace, identity.release)
        guard_name = f"{identity.release}-{identity.namespace}-guard"
        body = {"metadata": {"name": guard_name}, "webhooks": []}
        for plural in CONFIGS.values():
            base = f"{ADMISSION_API}/{plural}"

            async def listed(base: str = base) -> bool:
                return cp.request("GET", base, token=token)[0] == 200

            await eventually(listed, timeout=15)  # it may list them (the /status report)
            assert cp.request("POST", base, body, token=token)[0] == 403
            assert cp.request("POST", base, body)[0] == 201
            try:
                patch = [{"op": "add", "path": "/metadata/labels", "value": {"x": "y"}}]
                status, _ = cp.request(
                    "PATCH", f"{base}/{guard_name}", patch, token=token,
                    content_type="application/json-patch+json",
                )  # fmt: skip
                assert status == 403
                assert cp.request("DELETE", f"{base}/{guard_name}", token=token)[0] == 403
            finally:
                cp.request("DELETE", f"{base}/{guard_name}")
        assert (
            cp.request("GET", f"/api/v1/namespaces/{identity.namespace}/secrets", token=token)[0]
            == 403
        )
    finally:
        remove_cluster_objects(cp, identity)
