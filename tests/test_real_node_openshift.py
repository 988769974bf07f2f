"""OpenShift readiness on the real node (issue 47): the checkout's chart installed by the
helm CLI the way docs/install.md "OpenShift" says (namespace ``nvidia-gpu-operator``,
``admission.certificate.source=serviceCA``, the webhook guard of OpenShift's Kubernetes
minors), with no UID of its own; the pods started as a UID of the namespace's range that
the chart never names; the guard answering gpu-operator through the API server.

What OpenShift would do is played by the test, and only that:
- the restricted SCC: a MutatingAdmissionPolicy gives a pod without a runAsUser the first
  UID of the namespace's ``openshift.io/sa.scc.uid-range`` (and that fsGroup), and a
  ValidatingAdmissionPolicy refuses a pod whose UID is outside the range, as the SCC
  admission does (a chart that pinned a UID would not install);
- the service CA operator: it signs a certificate for the Service named by
  ``service.beta.openshift.io/serving-cert-secret-name`` into that Secret (tls.crt and
  tls.key, no ca.crt) and puts its CA into every webhook of a configuration annotated
  ``service.beta.openshift.io/inject-cabundle: "true"``.
Neither is OpenShift's code: what OpenShift itself does beyond these rules is not proven
here (docs/install.md says what is and is not)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from shared_svc.admission.certs import CA, ca_bundle_patch, cert_spec, make_pair
from testenv import ControlPlane
from testenv.node import Node
from tests.admission import ADMISSION_API
from tests.kube import eventually
from tests.real_node import (
    RELEASE,
    SERVICES,
    OperatorWorld,
    container_pids,
    get,
    guard_holds,
    install,
    operator_world,
    pod_manifest,
    pods,
    pods_of,
    process_field,
    process_identity,
    ready,
    service,
    uninstall,
    watching,
)

pytestmark = pytest.mark.node

NS = "nvidia-gpu-operator"  # gpu-operator's namespace on OpenShift (OperatorHub)
LOW, SIZE = 1000680000, 10000  # a namespace range as OpenShift allocates them
SCC = "shared-svc-test-restricted-scc"
SCC_LABEL = "shared-svc.test/scc"
GUARD = f"{RELEASE}-{NS}-guard"
SECRET = f"{RELEASE}-webhook-tls"
OPENSHIFT_VALUES = (
    "admission.certificate.source=serviceCA",
    # OpenShift 4.18 to 4.22 run Kubernetes 1.31 to 1.35: no MutatingAdmissionPolicy v1
    "admission.mutation=webhook",
)
RANGE = (
    'namespaceObject.metadata.annotations["openshift.io/sa.scc.uid-range"].split("/")'
)  # fmt: skip
MATCH = {
    "namespaceSelector": {"matchLabels": {SCC_LABEL: "restricted"}},
    "resourceRules": [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
        }
    ],
}


def scc_policies() -> list[tuple[str, dict[str, Any]]]:
    """(kind, spec) of the restricted SCC's two rules as admission policies and bindings."""
    first = f"int({RANGE}[0])"
    size = f"int({RANGE}[1])"
    within = "(u >= variables.low && u < variables.low + variables.size)"
    mutate = {
        "matchConstraints": MATCH,
        "failurePolicy": "Fail",
        "reinvocationPolicy": "Never",
        "matchConditions": [
            {
                "name": "no-uid",
                "expression": "!has(object.spec.securityContext) || "
                "!has(object.spec.securityContext.runAsUser)",
            }
        ],
        "mutations": [
            {
                "patchType": "ApplyConfiguration",
                "applyConfiguration": {
                    "expression": "Object{spec: Object.spec{securityContext: "
                    f"Object.spec.securityContext{{runAsUser: {first}, fsGroup: {first}}}}}}}"
                },
            }
        ],
    }
    validate = {
        "matchConstraints": MATCH,
        "failurePolicy": "Fail",
        "variables": [
            {"name": "low", "expression": first},
            {"name": "size", "expression": size},
            {
                "name": "uids",
                "expression": "(has(object.spec.securityContext) && "
                "has(object.spec.securityContext.runAsUser) ? "
                "[object.spec.securityContext.runAsUser] : []) + "
                "object.spec.containers.filter(c, has(c.securityContext) && "
                "has(c.securityContext.runAsUser)).map(c, c.securityContext.runAsUser)",
            },
        ],
        "validations": [
            {
                "expression": f"variables.uids.all(u, {within})",
                "message": "runAsUser outside the namespace's UID range (restricted SCC)",
            }
        ],
    }
    binding = {"policyName": SCC}
    return [
        ("MutatingAdmissionPolicy", mutate),
        ("MutatingAdmissionPolicyBinding", binding),
        ("ValidatingAdmissionPolicy", validate),
        ("ValidatingAdmissionPolicyBinding", {**binding, "validationActions": ["Deny"]}),
    ]


def admission_object(kind: str, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(collection path, object) of a cluster-scoped admission kind named ``SCC``."""
    body = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": SCC},
        "spec": spec,
    }
    plural = kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s"
    return f"{ADMISSION_API}/{plural}", body


@contextlib.contextmanager
def restricted_scc(cp: ControlPlane) -> Iterator[None]:
    """The namespace labelled and annotated as OpenShift's, the SCC's rules in force."""
    status, out = cp.request(
        "PATCH",
        f"/api/v1/namespaces/{NS}",
        {
            "metadata": {
                "labels": {SCC_LABEL: "restricted"},
                "annotations": {
                    "openshift.io/sa.scc.uid-range": f"{LOW}/{SIZE}",
                    "openshift.io/sa.scc.supplemental-groups": f"{LOW}/{SIZE}",
                },
            }
        },
        content_type="application/merge-patch+json",
    )
    assert status == 200, out
    policies = [admission_object(kind, spec) for kind, spec in scc_policies()]
    try:
        for path, body in policies:
            status, out = cp.request("POST", path, body)
            assert status == 201, (path, status, out)
        yield
    finally:
        for path, body in reversed(policies):
            cp.request("DELETE", f"{path}/{body['metadata']['name']}")


class ServiceCA:
    """OpenShift's service CA operator, for this namespace: a serving certificate for each
    Service annotated with a secret name, its CA injected into the annotated webhook
    configurations; ``ca`` is the bundle (base64 PEM) it injects."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.ca = ""
        self.signed: set[str] = set()

    async def run(self) -> None:
        while True:
            self.step()
            await asyncio.sleep(0.5)

    def step(self) -> None:
        status, listed = self.cp.request("GET", f"/api/v1/namespaces/{NS}/services")
        assert status == 200, listed
        for svc in listed["items"]:
            annotations = svc["metadata"].get("annotations") or {}
            secret = annotations.get("service.beta.openshift.io/serving-cert-secret-name")
            if secret and svc["metadata"]["name"] not in self.signed:
                self.sign(svc, secret)
        if not self.ca:
            return
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            status, listed = self.cp.request("GET", f"{ADMISSION_API}/{kind}")
            assert status == 200, listed
            for config in listed["items"]:
                annotations = config["metadata"].get("annotations") or {}
                if annotations.get("service.beta.openshift.io/inject-cabundle") != "true":
                    continue
                ops = ca_bundle_patch(config, self.ca)
                if ops:
                    path = f"{ADMISSION_API}/{kind}/{config['metadata']['name']}"
                    status, out = self.cp.request(
                        "PATCH", path, ops, content_type="application/json-patch+json"
                    )
                    assert status in (200, 409, 422), out  # changed meanwhile: next round

    def sign(self, svc: dict[str, Any], secret: str) -> None:
        name = svc["metadata"]["name"]
        pair = make_pair(cert_spec(name, NS), dt.datetime.now(dt.UTC))
        self.ca = pair.pop(CA)  # the operator's Secret holds the pair only
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": secret,
                "namespace": NS,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Service",
                        "name": name,
                        "uid": svc["metadata"]["uid"],
                    }
                ],
            },
            "data": pair,
        }
        status, out = self.cp.request("POST", f"/api/v1/namespaces/{NS}/secrets", body)
        if status == 409:  # one left by an earlier run: the operator regenerates it
            status, out = self.cp.request("PUT", f"/api/v1/namespaces/{NS}/secrets/{secret}", body)
        assert status in (200, 201), out
        self.signed.add(name)


@pytest.fixture(scope="module")
async def world(
    real_node: Node, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[OperatorWorld]:
    async with operator_world(real_node.control_plane, NS, tmp_path_factory.mktemp("op")) as w:
        yield w


async def test_the_chart_runs_as_the_namespace_s_uid_with_service_ca_certificates(
    real_node: Node, world: OperatorWorld
) -> None:
    cp = real_node.control_plane
    with restricted_scc(cp):
        # The SCC's rules are in force: a pod without a UID gets the range's first, a
        # pod with a UID of its own outside the range is refused (dry runs).
        async def assigned() -> int | None:
            await asyncio.sleep(0)
            status, out = cp.request(
                "POST", f"/api/v1/namespaces/{NS}/pods?dryRun=All", pod_manifest("probe")
            )
            context = out.get("spec", {}).get("securityContext", {}) if status == 201 else {}
            uid: int | None = context.get("runAsUser")
            return uid

        assert await eventually(assigned, timeout=60, interval=0.5) == LOW

        async def refused() -> bool:
            await asyncio.sleep(0)
            pinned = pod_manifest("pinned", securityContext={"runAsUser": 65532})
            status, out = cp.request("POST", f"/api/v1/namespaces/{NS}/pods?dryRun=All", pinned)
            return status in (403, 422) and "UID range" in str(out)

        await eventually(refused, timeout=60, interval=0.5)

        ca = ServiceCA(cp)
        operator = asyncio.create_task(ca.run())
        try:
            await asyncio.to_thread(install, real_node, *OPENSHIFT_VALUES, namespace=NS)
            await check_release(real_node, world, ca)
            await uninstall_under_the_range(real_node)
        finally:
            try:
                await asyncio.to_thread(uninstall, real_node, namespace=NS)  # if still there
            finally:
                operator.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await operator


async def check_release(node: Node, world: OperatorWorld, ca: ServiceCA) -> None:
    cp = node.control_plane
    selector = f"app.kubernetes.io/name=shared-svc,app.kubernetes.io/instance={RELEASE}"
    running = pods(cp, NS, selector)
    assert len(running) == 2 and all(ready(p) for p in running), running
    # The chart named no UID; each pod runs as the one the SCC stand-in gave it.
    deploy = get(cp, f"/apis/apps/v1/namespaces/{NS}/deployments/{RELEASE}")
    assert deploy is not None
    template = deploy["spec"]["template"]["spec"]
    assert "runAsUser" not in template["securityContext"]
    assert "runAsUser" not in template["containers"][0]["securityContext"]
    for pod in running:
        assert pod["spec"]["securityContext"]["runAsUser"] == LOW
        (state,) = pod["status"]["containerStatuses"]
        assert state["ready"] and state["restartCount"] == 0, state
    # The host's view: real, effective, saved and filesystem UIDs are the range's, not the
    # image's 65532; the primary group is 0 (no passwd entry for the UID, as on OpenShift)
    # and the fsGroup a supplementary one.
    for pid in container_pids(node, running):
        uids, root_options = process_identity(pid)
        assert uids == [str(LOW)] * 4, uids
        assert "ro" in root_options, root_options
        gids, groups = process_field(pid, "Gid"), process_field(pid, "Groups")
        assert gids == ["0"] * 4 and str(LOW) in groups, (gids, groups)

    # The certificates are the service CA's: the Secret it wrote, the bundle it injected
    # into both webhook configurations (the chart rendered none).
    secret = get(cp, f"/api/v1/namespaces/{NS}/secrets/{SECRET}")
    assert secret is not None and set(secret["data"]) == {"tls.crt", "tls.key"}
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        config = get(cp, f"{ADMISSION_API}/{kind}/{GUARD}")
        assert config is not None, kind
        assert config["webhooks"][0]["clientConfig"]["caBundle"] == ca.ca, kind
        assert base64.b64decode(ca.ca).startswith(b"-----BEGIN")

    # The guard answers gpu-operator, through the API server, from these pods: its delete
    # of a Service the ClusterPolicy needs is answered 404 by the webhook, its PUT of the
    # whole object changes nothing (the mutating webhook puts shared-svc's shape back).
    await guard_holds(cp, world, NS)
    for name in SERVICES:
        live = service(cp, name, NS)
        assert live is not None
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "shared-svc"

    # `helm test`: the probe Pod, under the range's UID too, judges the guard served.
    proc = node.helm("test", RELEASE, "-n", NS, "--logs", "--timeout", "3m", timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout


async def uninstall_under_the_range(node: Node) -> None:
    """``helm uninstall``: its pre-delete Job's pod runs under the range's UID too, and
    removes the guard."""
    cp = node.control_plane
    async with watching(cp, pods_of, NS) as seen:
        await asyncio.to_thread(uninstall, node, namespace=NS)
    remover = [
        o for _, o in seen.events if o["metadata"]["name"].startswith(f"{RELEASE}-guard-remove-")
    ]
    assert remover, [o["metadata"]["name"] for _, o in seen.events]
    assert {o["spec"]["securityContext"]["runAsUser"] for o in remover} == {LOW}
    for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
        assert get(cp, f"{ADMISSION_API}/{kind}/{GUARD}") is None, kind
