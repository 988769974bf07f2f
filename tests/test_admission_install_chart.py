"""The chart's certificate and install handling of the admission guard (issue 9 item 3):
the webhook served in cluster (Service, port, Secret, settings), the certificate from the
chart's hook Jobs, cert-manager or an external Secret, the uninstall hook, renders that
never change by themselves. tests/test_admission_hook_jobs.py runs the Jobs'
commands on the API server."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared_svc.cli import build_parser
from tests.test_deploy_chart import (
    CHART,
    REPO,
    Doc,
    RenderError,
    config_from_env,
    container_env,
    find,
    one,
    render,
    render_docs,
)

# All but test_helm_alone_would_delete_the_bindings_last and test_notes_say_what_uninstall_does
# render the chart (helmrender).
pytestmark = pytest.mark.helm

GUARD = "shared-svc-gpu-operator-guard"
WEBHOOKS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def hook(doc: Doc) -> str:
    return str((doc["metadata"].get("annotations") or {}).get("helm.sh/hook", ""))


def jobs(docs: list[Doc]) -> dict[str, Doc]:
    """hook events -> Job"""
    return {hook(d): d for d in find(docs, "Job")}


def job_args(job: Doc) -> Any:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return build_parser().parse_args(container["args"])


def test_webhook_is_served_in_cluster_by_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render_docs()
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    service = one(docs, "Service", "shared-svc-webhook")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "webhook", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    config = config_from_env(container_env(docs), monkeypatch)
    assert config.webhook_port == 8443
    mount = container["volumeMounts"][0]
    assert mount["readOnly"] and config.webhook_cert_file == f"{mount['mountPath']}/tls.crt"
    assert config.webhook_key_file == f"{mount['mountPath']}/tls.key"
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["secret"]["secretName"] == "shared-svc-webhook-tls"
    for kind in WEBHOOKS:
        config_doc = one(docs, kind, GUARD)
        for webhook in config_doc["webhooks"]:
            assert webhook["failurePolicy"] == "Ignore"
            assert webhook["clientConfig"]["service"]["name"] == "shared-svc-webhook"
            assert webhook["clientConfig"]["service"]["port"] == 443
            # written by the Job, so never rendered (an upgrade would reset it)
            assert "caBundle" not in webhook["clientConfig"]
    # Off: no server, no Service, no Secret to mount.
    off = render_docs("admission.webhook.enabled=false")
    assert not find(off, "Service", "shared-svc-webhook") and not find(off, "Job")
    assert "SHARED_SVC_WEBHOOK_CERT_FILE" not in container_env(off)
    assert "volumes" not in one(off, "Deployment")["spec"]["template"]["spec"]


def test_mutating_webhook_only_where_the_policy_is_not_used() -> None:
    assert {d["kind"] for d in render_docs() if d["kind"] in WEBHOOKS} == set(WEBHOOKS)
    policy = render_docs("admission.mutation=policy")
    assert {d["kind"] for d in policy if d["kind"] in WEBHOOKS} == {
        "ValidatingWebhookConfiguration"
    }
    assert find(policy, "MutatingAdmissionPolicyBinding")


def test_chart_certificate_jobs_make_the_secret_the_pods_mount_and_patch_ours() -> None:
    docs = render_docs()
    by_hook = jobs(docs)
    assert set(by_hook) == {"pre-install,pre-upgrade", "post-install,post-upgrade", "pre-delete"}
    mounted = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]["secret"]
    for events in ("pre-install,pre-upgrade", "post-install,post-upgrade"):
        job = by_hook[events]
        annotations = job["metadata"]["annotations"]
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        args = job_args(job)
        assert args.admission_command == "certs"
        assert args.secret == ("gpu-operator", mounted["secretName"])
        assert args.service == "shared-svc-webhook"
        assert args.webhook == [("mutating", GUARD), ("validating", GUARD)]
        assert args.san == []
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "shared-svc-certs"
        assert (
            pod["containers"][0]["image"]
            == one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
        )
        # the Job's identity exists before the Job runs, in every phase it runs
        for kind in ("ServiceAccount", "Role", "RoleBinding"):
            identity = one(docs, kind, "shared-svc-certs")
            assert set(hook(identity).split(",")) >= set(events.split(","))
            assert int(identity["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
                annotations["helm.sh/hook-weight"]
            )
    # The mutating webhook is not rendered under the policy: the Job does not name it.
    policy = jobs(render_docs("admission.mutation=policy"))
    assert job_args(policy["post-install,post-upgrade"]).webhook == [("validating", GUARD)]
    # Out of cluster, the certificate also names the URL's host.
    url = jobs(render_docs("admission.webhook.url=https://127.0.0.1:9443/"))
    assert job_args(url["pre-install,pre-upgrade"]).san == ["127.0.0.1"]


def test_cert_manager_issues_and_injects() -> None:
    docs = render_docs("admission.certificate.source=certManager", name="gpu", namespace="ops")
    assert not find(docs, "Job", "gpu-shared-svc-certs-pre")
    assert {hook(j) for j in find(docs, "Job")} == {"pre-delete"}
    cert = one(docs, "Certificate")
    issuer = one(docs, "Issuer")
    assert cert["metadata"]["namespace"] == "ops" and issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    assert "gpu-shared-svc-webhook.ops.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["duration"] == "87600h"
    volume = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    for kind in WEBHOOKS:
        config = one(docs, kind)
        assert config["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": f"ops/{cert['metadata']['name']}"
        }
        assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    own = render_docs(
        "admission.certificate.source=certManager",
        "admission.certificate.certManager.issuerRef.name=corp-ca",
        "admission.certificate.certManager.issuerRef.kind=ClusterIssuer",
    )
    assert not find(own, "Issuer")
    assert one(own, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_openshift_service_ca_signs_the_service_and_injects_its_bundle() -> None:
    # OpenShift's service CA operator: the Service's serving-cert-secret-name annotation
    # makes it write the Service's certificate (tls.crt, tls.key) into that Secret, and
    # inject-cabundle on a webhook configuration makes it fill every webhook's caBundle.
    docs = render_docs("admission.certificate.source=serviceCA", name="gpu", namespace="ops")
    assert {hook(j) for j in find(docs, "Job")} == {"pre-delete"}, "no certificate Job"
    assert not find(docs, "Certificate") and not find(docs, "Issuer")
    service = one(docs, "Service", "gpu-shared-svc-webhook")
    secret = service["metadata"]["annotations"][
        "service.beta.openshift.io/serving-cert-secret-name"
    ]
    volume = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == secret == "gpu-shared-svc-webhook-tls"
    assert [i["key"] for i in volume["secret"]["items"]] == ["tls.crt", "tls.key"], (
        "the service CA's Secret has no ca.crt"
    )
    for kind in WEBHOOKS:
        config = one(docs, kind)
        assert config["metadata"]["annotations"] == {
            "service.beta.openshift.io/inject-cabundle": "true"
        }
        client = config["webhooks"][0]["clientConfig"]
        assert "caBundle" not in client, "the operator's bundle would be reset on every sync"
        assert client["service"]["name"] == service["metadata"]["name"]
        assert client["service"]["namespace"] == "ops"
    remove = job_args(jobs(docs)["pre-delete"])
    assert remove.secret is None, "the operator's Secret is not the chart's to delete"
    # other sources carry no OpenShift annotation
    for source in ("chart", "certManager"):
        text = render(f"admission.certificate.source={source}")
        assert "service.beta.openshift.io" not in text, source
    named = render_docs(
        "admission.certificate.source=serviceCA", "admission.certificate.secretName=ocp-tls"
    )
    assert one(named, "Service", "shared-svc-webhook")["metadata"]["annotations"] == {
        "service.beta.openshift.io/serving-cert-secret-name": "ocp-tls"
    }
    with pytest.raises(RenderError, match=r"serviceCA.*admission\.webhook\.url"):
        render("admission.certificate.source=serviceCA", "admission.webhook.url=https://1.2.3.4")
    with pytest.raises(RenderError, match="caBundle goes with"):
        render("admission.certificate.source=serviceCA", "admission.webhook.caBundle=Q0E=")


def test_external_certificate_is_mounted_and_its_ca_rendered() -> None:
    docs = render_docs(
        "admission.certificate.source=external",
        "admission.certificate.secretName=my-tls",
        "admission.webhook.caBundle=Q0E=",
    )
    assert {hook(j) for j in find(docs, "Job")} == {"pre-delete"}
    assert not find(docs, "Certificate")
    volume = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"]["secretName"] == "my-tls"
    for kind in WEBHOOKS:
        assert one(docs, kind)["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E="
    remove = job_args(jobs(docs)["pre-delete"])
    assert remove.secret is None, "a Secret the chart did not make is not the chart's to delete"


@pytest.mark.parametrize(
    ("sets", "binding", "webhooks"),
    [
        ((), [], [("mutating", GUARD), ("validating", GUARD)]),
        (("admission.mutation=policy",), [GUARD], [("validating", GUARD)]),
        (("admission.mutation=policy", "admission.webhook.enabled=false"), [GUARD], []),
    ],
)
def test_uninstall_hook_removes_the_switches_first(
    sets: tuple[str, ...], binding: list[str], webhooks: list[tuple[str, str]]
) -> None:
    docs = render_docs(*sets)
    job = jobs(docs)["pre-delete"]
    args = job_args(job)
    assert args.admission_command == "remove"
    assert args.policy_binding == binding and args.webhook == webhooks
    assert args.secret == (("gpu-operator", "shared-svc-webhook-tls") if webhooks else None)
    # what it removes is what the chart rendered
    rendered = {
        d["metadata"]["name"] for d in docs if d["kind"] == "MutatingAdmissionPolicyBinding"
    }
    assert set(args.policy_binding) == rendered
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "shared-svc-guard-remove"
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
        (identity,) = [d for d in find(docs, kind) if "guard-remove" in d["metadata"]["name"]]
        assert hook(identity) == "pre-delete"
    assert not jobs(render_docs(*sets, "admission.preDeleteHook=false")).get("pre-delete")


def helm_uninstall_order() -> list[str]:
    """Helm's UninstallOrder, read from the helm.sh/helm/v3 module testenv builds with."""
    version = re.search(
        r"helm\.sh/helm/v3 (v\S+)", (REPO / "testenv" / "helmrender" / "go.mod").read_text()
    )
    assert version
    gomodcache = subprocess.run(
        ["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    source = (
        Path(gomodcache) / f"helm.sh/helm/v3@{version.group(1)}/pkg/releaseutil/kind_sorter.go"
    ).read_text()
    block = re.search(r"var UninstallOrder KindSortOrder = \[\]string\{(.*?)\}", source, re.S)
    assert block
    return re.findall(r'"(\w+)"', block.group(1))


def test_helm_alone_would_delete_the_bindings_last() -> None:
    # Why the pre-delete hook: Helm deletes kinds it does not know last (alphabetically),
    # after the Deployment that serves the webhooks and after the policy of a binding.
    order = helm_uninstall_order()
    assert "Deployment" in order and "Service" in order
    assert not {
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
        *WEBHOOKS,
    } & set(order)


# admission value -> a --set that changes it (every leaf of values.yaml's admission).
ADMISSION_CASES = {
    "admission.mutation": "admission.mutation=policy",
    "admission.deleteGuard": "admission.deleteGuard=false",
    "admission.operatorServiceAccount": "admission.operatorServiceAccount=gpu-op",
    "admission.operatorFieldManager": "admission.operatorFieldManager=gpu-op",
    "admission.preDeleteHook": "admission.preDeleteHook=false",
    "admission.webhook.enabled": "admission.webhook.enabled=false",
    "admission.webhook.port": "admission.webhook.port=9443",
    "admission.webhook.hostNetwork": "admission.webhook.hostNetwork=true",
    "admission.webhook.url": "admission.webhook.url=https://127.0.0.1:9443",
    "admission.webhook.caBundle": (
        "admission.certificate.source=external",
        "admission.webhook.caBundle=Q0E=",
    ),
    "admission.webhook.timeoutSeconds": "admission.webhook.timeoutSeconds=9",
    "admission.certificate.source": "admission.certificate.source=certManager",
    "admission.certificate.secretName": "admission.certificate.secretName=my-tls",
    "admission.certificate.validityDays": "admission.certificate.validityDays=365",
    "admission.certificate.certManager.issuerRef": (
        "admission.certificate.source=certManager",
        "admission.certificate.certManager.issuerRef.name=corp",
    ),
}


def leaves(tree: dict[str, Any], prefix: str) -> set[str]:
    out: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_every_admission_value_renders_and_changes_the_output() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert leaves(values["admission"], "admission.") == set(ADMISSION_CASES)
    default = render()
    for key, sets in ADMISSION_CASES.items():
        sets = (sets,) if isinstance(sets, str) else sets
        assert render(*sets) != default, f"{key}: no effect"
    # the two-value cases: the second value changes what the first alone renders
    issuer = ADMISSION_CASES["admission.certificate.certManager.issuerRef"]
    assert render(*issuer) != render(issuer[0])
    ca_bundle = render(*ADMISSION_CASES["admission.webhook.caBundle"])
    assert "caBundle: " in ca_bundle and "caBundle: " not in default


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("admission.mutation=policy", "admission.certificate.source=certManager"),
        ("admission.webhook.url=https://127.0.0.1:9443",),
    ],
)
def test_rendering_twice_gives_the_same_manifests(sets: tuple[str, ...]) -> None:
    # nothing random, no lookup: Argo CD and Flux re-render on every sync
    assert render(*sets) == render(*sets)
    for template in (CHART / "templates").glob("*"):
        actions = " ".join(re.findall(r"\{\{(?!-? */\*)(.*?)\}\}", template.read_text(), re.S))
        for word in ("lookup", "genCA", "genSignedCert", "randAlphaNum", "uuidv4", "now"):
            assert not re.search(rf"\b{word}\b", actions), f"{template.name}: {word}"


def test_notes_say_what_uninstall_does() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "helm uninstall" in notes and "pre-delete" in notes


# --- reachability where control planes are fenced (issue 43) ------------------------------


@pytest.mark.parametrize("port", [10250, 443])
def test_the_webhook_port_moves_the_container_port_and_the_service_follows_by_name(
    port: int,
) -> None:
    """GKE private clusters: the control plane reaches pods on 443 and 10250 only."""
    docs = render_docs(f"admission.webhook.port={port}", "networkPolicy.enabled=true")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert {"name": "webhook", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert container_env(docs)["SHARED_SVC_WEBHOOK_PORT"] == str(port)
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    service = one(docs, "Service", "shared-svc-webhook")["spec"]
    assert service["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    policy = one(docs, "NetworkPolicy")["spec"]
    assert {"ports": [{"port": "webhook", "protocol": "TCP"}]} in policy["ingress"]


def test_host_network_serves_the_webhook_on_the_node_and_still_resolves_cluster_names() -> None:
    """EKS with a custom CNI: the control plane reaches no pod IP, only the nodes."""
    docs = render_docs(
        "admission.webhook.hostNetwork=true",
        "admission.webhook.port=9443",
        "networkPolicy.enabled=true",
    )
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    [container] = pod["containers"]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    assert one(docs, "NetworkPolicy")["spec"]["ingress"][-1]["ports"] == [
        {"port": "webhook", "protocol": "TCP"}
    ]
    # with the webhook served elsewhere, the pods keep their own network
    away = render_docs("admission.webhook.hostNetwork=true", "admission.webhook.enabled=false")
    assert "hostNetwork" not in one(away, "Deployment")["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("admission.webhook.port=10250",), "10250 is taken on the node"),
        (("admission.webhook.port=8080",), "8080 is taken on the node"),
        (
            ("admission.webhook.url=https://127.0.0.1:9443",),
            "does not go with admission.webhook.url",
        ),
    ],
)
def test_host_network_refuses_a_port_the_node_already_uses(
    sets: tuple[str, ...], message: str
) -> None:
    with pytest.raises(RenderError, match=message):
        render("admission.webhook.hostNetwork=true", *sets)


def test_helm_test_probes_the_guard_as_the_service_in_a_pod_no_service_selects() -> None:
    """``helm test``: ``shared-svc admission probe`` once, under shared-svc's own
    ServiceAccount (no right of its own), never behind one of shared-svc's Services."""
    from shared_svc.cli import main

    docs = render_docs(namespace="ops")
    [pod] = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert (
        spec["serviceAccountName"]
        == one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    )
    assert spec["restartPolicy"] == "Never"
    [container] = spec["containers"]
    assert container["args"] == ["admission", "probe", "--namespace", "ops"]
    assert (
        container["image"]
        == one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    labels = pod["metadata"]["labels"]
    for selecting in [*find(docs, "Service"), *find(docs, "PodDisruptionBudget")]:
        selector = selecting["spec"].get("selector") or {}
        selector = selector.get("matchLabels", selector)
        assert not selector.items() <= labels.items(), selecting["metadata"]["name"]
    # the CLI takes exactly these arguments (a wrong one would be a usage error, exit 2)
    with pytest.raises(SystemExit) as help_exit:
        main([*container["args"], "--help"])
    assert help_exit.value.code == 0
    # left out where there is no guard to probe, or when switched off (plain manifests)
    assert not find(render_docs("helmTest.enabled=false"), "Pod")
    assert not find(render_docs("admission.webhook.enabled=false"), "Pod")
