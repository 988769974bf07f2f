"""The Helm chart, rendered by Helm's own engine (``testenv/helmrender``, built from the
helm.sh/helm/v3 Go module by ``testenv/helmrender/build.sh``; no download at test time).

Also the rendering helpers used by ``test_deploy_rbac.py`` and ``test_config_doc.py``.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import testenv
from shared_svc.config import Config
from shared_svc.reconcile.names import SERVICE_MONITOR_NAMES, SERVICE_NAMES
from shared_svc.runtime.controller import DRAIN_SECONDS

# Every test here but test_every_chart_setting_is_covered_by_a_value_case runs helmrender.
pytestmark = pytest.mark.helm

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "chart" / "shared-svc"
MANIFESTS = REPO / "deploy" / "manifests"
# Plain manifest -> the --set flags it was rendered with (deploy/render.sh).
PLAIN_SETS = (
    "admission.mutation=policy",
    "admission.preDeleteHook=false",
    "helmTest.enabled=false",
)
PLAIN = {
    "shared-svc.yaml": PLAIN_SETS,
    "shared-svc-upgrade.yaml": (*PLAIN_SETS, "controllers.upgrade=true"),
}
UPGRADE_ON = ("controllers.upgrade=true",)

Doc = dict[str, Any]


class RenderError(Exception):
    """helmrender refused the chart or the values; the message is its stderr."""


@functools.cache
def helmrender() -> Path:
    binary = testenv.build_helmrender()
    if not binary.exists():
        raise AssertionError(f"{binary} missing: testenv/helmrender/build.sh builds it")
    return binary


def render(
    *sets: str,
    name: str = "shared-svc",
    namespace: str = "gpu-operator",
    kubeconfig: Path | None = None,
    flags: tuple[str, ...] = (),
) -> str:
    """The chart's manifests as `helm template` prints them, with ``--set`` values; with
    ``kubeconfig``, as `helm install` renders them on that cluster (its version and API
    versions); ``flags``: more helmrender flags (``--kube-version``, ``--api-versions``)."""
    args = [str(helmrender()), "--name", name, "--namespace", namespace, *flags]
    if kubeconfig is not None:
        args += ["--kubeconfig", str(kubeconfig)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(
        [*args, str(CHART)], capture_output=True, text=True, check=False, timeout=60
    )
    if proc.returncode != 0:
        raise RenderError(proc.stderr.strip())
    return proc.stdout


def render_docs(
    *sets: str,
    name: str = "shared-svc",
    namespace: str = "gpu-operator",
    kubeconfig: Path | None = None,
    flags: tuple[str, ...] = (),
) -> list[Doc]:
    text = render(*sets, name=name, namespace=namespace, kubeconfig=kubeconfig, flags=flags)
    return [d for d in yaml.safe_load_all(text) if d]


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, (
        f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    )
    return found[0]


def container_env(docs: list[Doc]) -> dict[str, Any]:
    """Env of the shared-svc container: name -> value (or the valueFrom dict)."""
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def rules(doc: Doc) -> set[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(apiGroup, resource, verbs, resourceNames) for each group x resource of a role."""
    out = set()
    for rule in doc.get("rules") or []:
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                out.add(
                    (
                        group,
                        resource,
                        tuple(sorted(rule["verbs"])),
                        tuple(sorted(rule.get("resourceNames", []))),
                    )
                )
    return out


def rbac_docs(docs: list[Doc]) -> list[Doc]:
    kinds = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    return [d for d in docs if d["kind"] in kinds]


def strip_header(text: str) -> str:
    """A plain manifest without its leading comment lines (deploy/render.sh's header)."""
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


# --- the plain manifests are the chart ---
@pytest.mark.parametrize("filename", sorted(PLAIN))
def test_plain_manifests_are_the_rendered_chart(filename: str) -> None:
    plain = strip_header((MANIFESTS / filename).read_text())
    assert plain == render(*PLAIN[filename]), (
        f"deploy/manifests/{filename} is stale: run deploy/render.sh"
    )
    assert all(
        d["metadata"].get("namespace") in (None, "gpu-operator", "default")
        for d in yaml.safe_load_all(plain)
        if d
    )


# --- least privilege ---
# Writes only under the contract's names (shared_svc/reconcile/names.py); list/watch cannot
# name objects. An apply that creates is a PATCH on the name (create is checked on the name).
SERVICES_ROLE = {
    ("", "services", ("list", "watch"), ()),
    ("", "services", ("create", "delete", "patch"), tuple(sorted(SERVICE_NAMES))),
    ("monitoring.coreos.com", "servicemonitors", ("list", "watch"), ()),
    (
        "monitoring.coreos.com",
        "servicemonitors",
        ("create", "delete", "patch"),
        SERVICE_MONITOR_NAMES,
    ),
    ("apps", "daemonsets", ("list", "watch"), ()),
    ("", "pods", ("list", "watch"), ()),
    ("coordination.k8s.io", "leases", ("create",), ()),
    ("coordination.k8s.io", "leases", ("get", "update"), ("shared-svc",)),
    ("events.k8s.io", "events", ("create", "get", "patch"), ()),
}
EVENTS_ONLY = {("events.k8s.io", "events", ("create", "get", "patch"), ())}
CR_READER = {
    ("nvidia.com", "clusterpolicies", ("list", "watch"), ()),
    ("nvidia.com", "gpuclusters", ("list", "watch"), ()),
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("get",),
        (
            "clusterpolicies.nvidia.com",
            "gpuclusters.nvidia.com",
            "servicemonitors.monitoring.coreos.com",
        ),
    ),
    # which admission guard is active (shared_svc/admission/guard.py): list, never write
    ("admissionregistration.k8s.io", "mutatingadmissionpolicybindings", ("list",), ()),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("list",), ()),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", ("list",), ()),
}
UPGRADE = {
    ("", "nodes", ("list", "patch", "watch"), ()),  # no get: nodes come from the cache
    ("", "pods", ("list",), ()),
    ("", "pods/eviction", ("create",), ()),
    ("apps", "daemonsets", ("list", "watch"), ()),
    # the upgrade policy gpu-operator reads and its gate: read, never written
    # (configure-gate is the admin's)
    ("nvidia.com", "clusterpolicies", ("list", "watch"), ()),
    ("nvidia.com", "nvidiadrivers", ("list", "watch"), ()),
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("get",),
        ("clusterpolicies.nvidia.com", "nvidiadrivers.nvidia.com"),
    ),
    # the NVIDIADriver CRD, by name: does it have spec.upgradePolicy (gpu-operator v26.7)?
    (
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        ("nvidiadrivers.nvidia.com",),
    ),
}


def role_table(docs: list[Doc]) -> dict[tuple[str, str, str], set[Any]]:
    return {
        (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace", "")): rules(d)
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }


GUARD = "shared-svc-gpu-operator-guard"
WEBHOOK_SECRET = "shared-svc-webhook-tls"
# The hook Jobs' own identities (templates/webhook-certs-job.yaml, admission-uninstall.yaml):
# the certificate Job creates its Secret and patches only our webhook configurations; the
# uninstall Job deletes only our binding, webhook configurations and generated Secret.
CERTS_ROLE = {
    ("", "secrets", ("create",), ()),
    ("", "secrets", ("get", "update"), (WEBHOOK_SECRET,)),
}
CERTS_CLUSTER_ROLE = {
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("get", "patch"), (GUARD,)),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", ("get", "patch"), (GUARD,)),
}
REMOVE_ROLE = {("", "secrets", ("delete",), (WEBHOOK_SECRET,))}
REMOVE_CLUSTER_ROLE = {
    ("admissionregistration.k8s.io", plural, ("delete",), (GUARD,))
    for plural in (
        "mutatingadmissionpolicybindings",
        "mutatingwebhookconfigurations",
        "validatingwebhookconfigurations",
    )
}
HOOK_ROLES = {
    ("Role", "shared-svc-certs", "gpu-operator"): CERTS_ROLE,
    ("ClusterRole", "shared-svc-certs-gpu-operator", ""): CERTS_CLUSTER_ROLE,
    ("Role", "shared-svc-guard-remove", "gpu-operator"): REMOVE_ROLE,
    ("ClusterRole", "shared-svc-guard-remove-gpu-operator", ""): REMOVE_CLUSTER_ROLE,
}
WRITES = {"create", "update", "patch", "delete", "deletecollection", "*"}


def roles_of(docs: list[Doc], service_account: str) -> set[tuple[str, str, str]]:
    """(kind, name, namespace) of each role bound to ``service_account``."""
    out = set()
    for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        if any(s["name"] == service_account for s in binding["subjects"]):
            ns = (
                binding["metadata"].get("namespace", "") if binding["kind"] == "RoleBinding" else ""
            )
            out.add((binding["roleRef"]["kind"], binding["roleRef"]["name"], ns))
    return out


def test_rbac_is_exactly_what_the_services_controller_calls() -> None:
    docs = render_docs()
    assert role_table(docs) == {
        ("Role", "shared-svc", "gpu-operator"): SERVICES_ROLE,
        ("Role", "shared-svc-cluster-events", "default"): EVENTS_ONLY,
        ("ClusterRole", "shared-svc", ""): CR_READER,
        **HOOK_ROLES,
    }
    # Each identity holds its own roles only.
    assert roles_of(docs, "shared-svc") == {
        ("Role", "shared-svc", "gpu-operator"),
        ("Role", "shared-svc-cluster-events", "default"),
        ("ClusterRole", "shared-svc", ""),
    }
    assert roles_of(docs, "shared-svc-certs") == {
        ("Role", "shared-svc-certs", "gpu-operator"),
        ("ClusterRole", "shared-svc-certs-gpu-operator", ""),
    }
    assert roles_of(docs, "shared-svc-guard-remove") == {
        ("Role", "shared-svc-guard-remove", "gpu-operator"),
        ("ClusterRole", "shared-svc-guard-remove-gpu-operator", ""),
    }


@pytest.mark.parametrize(
    "sets",
    [(), ("admission.mutation=policy",), ("admission.certificate.source=certManager",), PLAIN_SETS],
)
def test_shared_svc_never_writes_admission_objects_or_secrets(sets: tuple[str, ...]) -> None:
    docs = render_docs(*sets, *UPGRADE_ON)
    table = role_table(docs)
    for key in roles_of(docs, "shared-svc"):
        for group, resource, verbs, _ in table[key]:
            if group == "admissionregistration.k8s.io":
                assert not WRITES & set(verbs), (key, resource, verbs)
            assert resource != "secrets", key


def test_upgrade_controller_adds_its_cluster_role_only_when_on() -> None:
    off, on = render_docs(), render_docs(*UPGRADE_ON)
    off_rules = set().union(*role_table(off).values())
    assert not {r for r in off_rules if r[1] in ("nodes", "pods/eviction")}
    assert not any(r[2] and "delete" in r[2] and r[1] == "pods" for r in off_rules)
    assert not find(off, "ClusterRole", "shared-svc-upgrade") and not find(
        off, "ClusterRoleBinding", "shared-svc-upgrade"
    )
    assert role_table(on) == {
        **role_table(off),
        ("ClusterRole", "shared-svc-upgrade", ""): UPGRADE,
    }
    binding = one(on, "ClusterRoleBinding", "shared-svc-upgrade")
    assert binding["roleRef"]["name"] == "shared-svc-upgrade"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "shared-svc", "namespace": "gpu-operator"}
    ]
    assert container_env(on)["SHARED_SVC_UPGRADE_CONTROLLER"] == "true"
    assert container_env(off)["SHARED_SVC_UPGRADE_CONTROLLER"] == "false"


def test_pod_delete_is_granted_only_with_delete_after_timeout() -> None:
    with_delete = render_docs(*UPGRADE_ON, "upgrade.deleteAfterTimeout=true")
    assert role_table(with_delete) == {
        **role_table(render_docs(*UPGRADE_ON)),
        ("ClusterRole", "shared-svc-upgrade", ""): (UPGRADE - {("", "pods", ("list",), ())})
        | {("", "pods", ("delete", "list"), ())},
    }
    assert container_env(with_delete)["SHARED_SVC_UPGRADE_DELETE_AFTER_TIMEOUT"] == "true"
    # The value alone, with the controller off, grants nothing.
    assert role_table(render_docs("upgrade.deleteAfterTimeout=true")) == role_table(render_docs())


def test_no_wildcards_secrets_or_escalation_anywhere() -> None:
    for docs in (render_docs(), render_docs(*UPGRADE_ON, "serviceMonitor.enabled=true")):
        for doc in docs:
            hook_role = (doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace", ""))
            for rule in doc.get("rules") or []:
                words = [*rule.get("apiGroups", []), *rule.get("resources", []), *rule["verbs"]]
                assert "*" not in words, doc["metadata"]["name"]
                # Secrets: only the hook Jobs' roles (exactly, test above), never shared-svc's.
                forbidden = {"configmaps", "clusterroles", "roles", "namespaces"}
                if hook_role not in HOOK_ROLES:
                    forbidden.add("secrets")
                assert not forbidden & set(rule.get("resources", []))
                assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(
                    rule["verbs"]
                )


def test_bindings_name_the_chart_service_account_in_the_operator_namespace() -> None:
    docs = render_docs(name="gpu-svc", namespace="ops")
    sa = one(docs, "ServiceAccount", "gpu-svc-shared-svc")
    assert sa["metadata"] == {**sa["metadata"], "name": "gpu-svc-shared-svc", "namespace": "ops"}
    for binding in find(docs, "RoleBinding") + find(docs, "ClusterRoleBinding"):
        # each hook Job's binding names that Job's own ServiceAccount (its role's prefix)
        account = next(
            n
            for n in (
                "gpu-svc-shared-svc-certs",
                "gpu-svc-shared-svc-guard-remove",
                "gpu-svc-shared-svc",
            )
            if binding["metadata"]["name"].startswith(n)
        )
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": "ops"}
        ]
    namespaces = {(d["kind"], d["metadata"]["name"]): d["metadata"].get("namespace") for d in docs}
    assert namespaces[("Role", "gpu-svc-shared-svc-cluster-events")] == "default"
    assert namespaces[("RoleBinding", "gpu-svc-shared-svc-cluster-events")] == "default"
    assert {
        ns
        for (kind, _), ns in namespaces.items()
        if kind in ("Deployment", "Service", "Role", "ServiceAccount")
    } >= {"ops"}


def test_namespace_value_moves_every_namespaced_object() -> None:
    docs = render_docs("namespaceOverride=nvidia-gpu", namespace="elsewhere")
    cluster_scoped = (
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    )
    for d in docs:
        if d["kind"] in cluster_scoped:
            assert "namespace" not in d["metadata"]
        elif d["metadata"]["name"] != "shared-svc-cluster-events":
            assert d["metadata"]["namespace"] == "nvidia-gpu", d["kind"]
    lease_rule = next(
        r for r in rules(one(docs, "Role", "shared-svc")) if r[1] == "leases" and r[3]
    )
    assert lease_rule[3] == ("shared-svc",)


# --- the Deployment ---
def test_deployment_is_hardened_and_probed() -> None:
    docs = render_docs()
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "shared-svc" and pod["automountServiceAccountToken"] is True
    assert one(docs, "ServiceAccount", "shared-svc").get("automountServiceAccountToken") is False, (
        "only the Deployment opts in"
    )
    # no UID of the chart's: the image's user (65532) here, the namespace's under
    # OpenShift's restricted SCC (docs/install.md "OpenShift")
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = pod["containers"]
    assert container["args"] == ["run"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "webhook", "containerPort": 8443, "protocol": "TCP"},
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    env = container_env(docs)
    assert env["OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["SHARED_SVC_LEADER_ELECTION"] == "true"
    selector = deploy["spec"]["selector"]["matchLabels"]
    spread = pod["topologySpreadConstraints"][0]
    assert (
        spread["topologyKey"] == "kubernetes.io/hostname"
        and spread["labelSelector"]["matchLabels"] == selector
    )
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0][
        "podAffinityTerm"
    ]
    assert (
        anti["topologyKey"] == "kubernetes.io/hostname"
        and anti["labelSelector"]["matchLabels"] == selector
    )
    # SIGTERM: the upgrade controller drains for up to DRAIN_SECONDS, then the Lease is
    # released; the kubelet's SIGKILL must not cut that release (docs/install.md). A release
    # slower than a Lease duration would gain nothing over letting the Lease expire.
    lease_duration = yaml.safe_load((CHART / "values.yaml").read_text())["leaderElection"][
        "leaseDurationSeconds"
    ]
    delay = yaml.safe_load((CHART / "values.yaml").read_text())["shutdownDelaySeconds"]
    assert delay > 0, "on by default"
    assert pod["terminationGracePeriodSeconds"] >= delay + DRAIN_SECONDS + lease_duration
    # A stopping pod serves on (its webhook above all) while the API server's view of the
    # endpoints drops it; the kubelet's own sleep, no binary in the image (docs/install.md).
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": delay}}}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    service = one(docs, "Service", "shared-svc-metrics")
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    assert not find(docs, "ServiceMonitor"), "off by default"


def test_service_monitor_and_single_replica_options() -> None:
    docs = render_docs(
        "serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom", "port=9090"
    )
    sm = one(docs, "ServiceMonitor")
    service = one(docs, "Service", "shared-svc-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["gpu-operator"]}
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert service["spec"]["ports"][0]["port"] == 9090
    assert container_env(docs)["SHARED_SVC_PORT"] == "9090"
    # what a user's Prometheus set-up asks of it (issue 46)
    tuned = one(
        render_docs(
            "serviceMonitor.enabled=true",
            "serviceMonitor.namespace=monitoring",
            "serviceMonitor.scrapeTimeout=10s",
            "serviceMonitor.honorLabels=true",
            "serviceMonitor.relabelings[0].targetLabel=cluster",
            "serviceMonitor.relabelings[0].replacement=gpu-east",
            "serviceMonitor.metricRelabelings[0].action=drop",
            "serviceMonitor.metricRelabelings[0].regex=python_gc_.*",
            "serviceMonitor.metricRelabelings[0].sourceLabels[0]=__name__",
        ),
        "ServiceMonitor",
    )
    assert tuned["metadata"]["namespace"] == "monitoring"
    assert tuned["spec"]["namespaceSelector"] == {"matchNames": ["gpu-operator"]}
    assert tuned["spec"]["endpoints"] == [
        {
            "port": "http",
            "path": "/metrics",
            "interval": "30s",
            "scrapeTimeout": "10s",
            "honorLabels": True,
            "relabelings": [{"targetLabel": "cluster", "replacement": "gpu-east"}],
            "metricRelabelings": [
                {"action": "drop", "regex": "python_gc_.*", "sourceLabels": ["__name__"]}
            ],
        }
    ]
    single = render_docs("replicas=1")
    assert not find(single, "PodDisruptionBudget"), (
        "minAvailable 1 of 1 would block every node drain"
    )


# --- values reach the service ---
# --set expression -> (env var, Config field, value the service must see)
VALUE_CASES: dict[str, tuple[str, str, Any]] = {
    "selectorMode=app": ("SHARED_SVC_SELECTOR_MODE", "selector_mode", "app"),
    "adopt=false": ("SHARED_SVC_ADOPT", "adopt", False),
    "dryRun=true": ("SHARED_SVC_DRY_RUN", "dry_run", True),
    "logLevel=DEBUG": ("SHARED_SVC_LOG_LEVEL", "log_level", "DEBUG"),
    "port=9091": ("SHARED_SVC_PORT", "port", 9091),
    "controllers.services=false": ("SHARED_SVC_SERVICES_CONTROLLER", "services_controller", False),
    "controllers.upgrade=true": ("SHARED_SVC_UPGRADE_CONTROLLER", "upgrade_controller", True),
    "leaderElection.leaseName=gpu-lease": ("SHARED_SVC_LEASE_NAME", "lease_name", "gpu-lease"),
    "leaderElection.leaseDurationSeconds=30": (
        "SHARED_SVC_LEASE_DURATION_SECONDS",
        "lease_duration_seconds",
        30.0,
    ),
    "leaderElection.renewDeadlineSeconds=20": (
        "SHARED_SVC_RENEW_DEADLINE_SECONDS",
        "renew_deadline_seconds",
        20.0,
    ),
    "leaderElection.retryPeriodSeconds=4": (
        "SHARED_SVC_RETRY_PERIOD_SECONDS",
        "retry_period_seconds",
        4.0,
    ),
    "upgrade.driverName=ofed": ("SHARED_SVC_UPGRADE_DRIVER_NAME", "upgrade_driver_name", "ofed"),
    "upgrade.consumerSelector=team=ml": (
        "SHARED_SVC_UPGRADE_CONSUMER_SELECTOR",
        "upgrade_consumer_selector",
        "team=ml",
    ),
    "upgrade.detection=evict": ("SHARED_SVC_UPGRADE_DETECTION", "upgrade_detection", "evict"),
    "admission.operatorServiceAccount=gpu-op": (
        "SHARED_SVC_OPERATOR_SERVICE_ACCOUNT",
        "operator_service_account",
        "gpu-op",
    ),
    "admission.operatorFieldManager=gpu-op-manager": (
        "SHARED_SVC_OPERATOR_FIELD_MANAGER",
        "operator_field_manager",
        "gpu-op-manager",
    ),
    "admission.webhook.port=9443": ("SHARED_SVC_WEBHOOK_PORT", "webhook_port", 9443),
    "upgrade.runtimeClasses={nvidia,kata}": (
        "SHARED_SVC_UPGRADE_RUNTIME_CLASSES",
        "upgrade_runtime_classes",
        ["nvidia", "kata"],
    ),
    "upgrade.evictionTimeoutSeconds=600": (
        "SHARED_SVC_UPGRADE_EVICTION_TIMEOUT_SECONDS",
        "upgrade_eviction_timeout_seconds",
        600.0,
    ),
    "upgrade.deleteAfterTimeout=true": (
        "SHARED_SVC_UPGRADE_DELETE_AFTER_TIMEOUT",
        "upgrade_delete_after_timeout",
        True,
    ),
    "upgrade.pollSeconds=7": ("SHARED_SVC_UPGRADE_POLL_SECONDS", "upgrade_poll_seconds", 7.0),
    "upgrade.resyncSeconds=90": (
        "SHARED_SVC_UPGRADE_RESYNC_SECONDS",
        "upgrade_resync_seconds",
        90.0,
    ),
    "upgrade.workers=8": ("SHARED_SVC_UPGRADE_WORKERS", "upgrade_workers", 8),
    "upgrade.writesPerSecond=50": (
        "SHARED_SVC_UPGRADE_WRITES_PER_SECOND",
        "upgrade_writes_per_second",
        50.0,
    ),
    "upgrade.writesBurst=80": ("SHARED_SVC_UPGRADE_WRITES_BURST", "upgrade_writes_burst", 80),
    "tuning.resyncSeconds=600": ("SHARED_SVC_RESYNC_SECONDS", "resync_seconds", 600.0),
    "tuning.discoverySeconds=30": ("SHARED_SVC_DISCOVERY_SECONDS", "discovery_seconds", 30.0),
    "tuning.scrapeIntervalSeconds=60": (
        "SHARED_SVC_SCRAPE_INTERVAL_SECONDS",
        "scrape_interval_seconds",
        60.0,
    ),
    "tuning.coalesceSeconds=0.5": ("SHARED_SVC_COALESCE_SECONDS", "coalesce_seconds", 0.5),
    "tuning.apiCompression=true": ("SHARED_SVC_API_COMPRESSION", "api_compression", True),
    "tuning.backoffBaseSeconds=0.01": (
        "SHARED_SVC_BACKOFF_BASE_SECONDS",
        "backoff_base_seconds",
        0.01,
    ),
    "tuning.backoffMaxSeconds=60": ("SHARED_SVC_BACKOFF_MAX_SECONDS", "backoff_max_seconds", 60.0),
    "tuning.writesPerSecond=5": ("SHARED_SVC_WRITES_PER_SECOND", "writes_per_second", 5.0),
    "tuning.writesBurst=20": ("SHARED_SVC_WRITES_BURST", "writes_burst", 20),
    "tuning.conflictingWriterThreshold=5": (
        "SHARED_SVC_CONFLICTING_WRITER_THRESHOLD",
        "conflicting_writer_threshold",
        5,
    ),
    "tuning.conflictingWriterWindowSeconds=900": (
        "SHARED_SVC_CONFLICTING_WRITER_WINDOW_SECONDS",
        "conflicting_writer_window_seconds",
        900.0,
    ),
    "tuning.conflictingWriterBackoffSeconds=120": (
        "SHARED_SVC_CONFLICTING_WRITER_BACKOFF_SECONDS",
        "conflicting_writer_backoff_seconds",
        120.0,
    ),
}


def config_from_env(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Config:
    """The settings the service builds from the container's environment (fieldRefs filled in)."""
    import os

    for key in list(os.environ):
        if key.startswith("SHARED_SVC_") or key in ("OPERATOR_NAMESPACE", "POD_NAME", "KUBECONFIG"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value if isinstance(value, str) else "from-field-ref")
    monkeypatch.setenv("OPERATOR_NAMESPACE", "gpu-operator")
    return Config()


def test_every_value_reaches_the_service_through_its_env(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render_docs(*VALUE_CASES)
    env = container_env(docs)
    config = config_from_env(env, monkeypatch)
    for expression, (var, field, expected) in VALUE_CASES.items():
        assert var in env, f"{expression}: no {var} in the container env"
        assert getattr(config, field) == expected, (
            f"{expression}: {var}={env[var]!r} gave {getattr(config, field)!r}"
        )
    assert config.namespace == "gpu-operator" and config.kubeconfig is None


def test_every_chart_setting_is_covered_by_a_value_case() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    settings = {
        k: values[k]
        for k in (
            "selectorMode",
            "adopt",
            "dryRun",
            "logLevel",
            "port",
            "controllers",
            "leaderElection",
            "upgrade",
            "tuning",
        )
    }
    settings["admission"] = {
        k: values["admission"][k] for k in ("operatorServiceAccount", "operatorFieldManager")
    }
    # the webhook server's port; the other admission values render objects, not settings
    # (tests/test_admission_install_chart.py covers every one of them)
    settings["admission"]["webhook"] = {"port": values["admission"]["webhook"]["port"]}

    def leaves(tree: dict[str, Any], prefix: str = "") -> set[str]:
        out: set[str] = set()
        for key, value in tree.items():
            out |= leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
        return out

    covered = {e.split("=", 1)[0] for e in VALUE_CASES} | {"leaderElection.enabled"}
    assert leaves(settings) == covered


def test_default_values_are_the_service_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's defaults configure the service exactly as its own defaults would."""
    config = config_from_env(container_env(render_docs(*UPGRADE_ON)), monkeypatch)
    defaults = Config(namespace="gpu-operator", upgrade_controller=True)
    for _, (_, field, _) in VALUE_CASES.items():
        if field in ("services_controller", "upgrade_controller"):
            continue
        assert getattr(config, field) == getattr(defaults, field), field


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("selectorMode=bogus",), "selectorMode"),
        (("upgrade.detection=kill",), "detection"),
        (("replicas=0",), "replicas"),
        (("tuning.writesBurst=0",), "writesBurst"),
        (("adopt=maybe",), "adopt"),
        (("selectorMod=app",), "selectorMod"),
        (("leaderElection.enabled=false",), "leaderElection.enabled=true"),
        (("controllers.services=false",), "nothing to run"),
        (("namespaceOverride=Bad_NS",), "namespaceOverride"),
    ],
)
def test_bad_values_fail_with_a_clear_message(sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(RenderError) as err:
        render(*sets)
    assert message in str(err.value)


def test_single_replica_without_leader_election_renders() -> None:
    docs = render_docs("replicas=1", "leaderElection.enabled=false")
    env = container_env(docs)
    assert env["SHARED_SVC_LEADER_ELECTION"] == "false" and "SHARED_SVC_LEASE_NAME" not in env
    assert not [r for r in rules(one(docs, "Role", "shared-svc")) if r[1] == "leases"]


# --- community conventions (issue 11) ---
def lint(*sets: str, namespace: str = "gpu-operator") -> subprocess.CompletedProcess[str]:
    """`helm lint --strict` (helm's pkg/lint, through helmrender --lint) with ``--set`` values."""
    args = [str(helmrender()), "--lint", "--strict", "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(
        [*args, str(CHART)], capture_output=True, text=True, check=False, timeout=60
    )


DIGEST = "sha256:" + "0123456789abcdef" * 4
# value -> --set expressions that change it (every leaf of the values below, CONVENTION_KEYS)
CONVENTION_CASES: dict[str, tuple[str, ...]] = {
    "nameOverride": ("nameOverride=dcgm-shared",),
    "fullnameOverride": ("fullnameOverride=gpu-shared",),
    "namespaceOverride": ("namespaceOverride=nvidia-gpu",),
    "image.digest": (f"image.digest={DIGEST}",),
    "serviceAccount.create": ("serviceAccount.create=false", "serviceAccount.name=existing"),
    "serviceAccount.name": ("serviceAccount.name=svc-identity",),
    "serviceAccount.annotations": (
        "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account=svc@p.iam",
    ),
    "priorityClassName": ("priorityClassName=system-node-critical",),
    "podLabels": ("podLabels.team=gpu",),
    "podAnnotations": ("podAnnotations.example\\.com/owner=gpu",),
    "podSecurityContext": ("podSecurityContext.fsGroup=65532",),
    "securityContext": ("securityContext.privileged=false",),
    "affinity": (
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=node-role.kubernetes.io/control-plane",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    ),
    "nodeSelector": ("nodeSelector.example\\.com/pool=system",),
    "topologySpreadConstraints": (
        "topologySpreadConstraints[0].maxSkew=1",
        "topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
    ),
    "extraEnv": ("extraEnv[0].name=HTTPS_PROXY", "extraEnv[0].value=http://proxy:3128"),
    "hooks.resources": ("hooks.resources.limits.memory=256Mi",),
    "extraObjects": (
        "extraObjects[0].apiVersion=v1",
        "extraObjects[0].kind=ConfigMap",
        "extraObjects[0].metadata.name=extra",
    ),
    "shutdownDelaySeconds": ("shutdownDelaySeconds=0",),
    "tolerations": (
        "tolerations[0].key=node-role.kubernetes.io/control-plane",
        "tolerations[0].operator=Exists",
        "tolerations[0].effect=NoSchedule",
    ),
    "prometheusRule.enabled": ("prometheusRule.enabled=true",),
    "prometheusRule.release": ("prometheusRule.enabled=true", "prometheusRule.release=prom"),
    "prometheusRule.job": ("prometheusRule.enabled=true", "prometheusRule.job=shared"),
    "prometheusRule.runbookBaseUrl": (
        "prometheusRule.enabled=true",
        "prometheusRule.runbookBaseUrl=https://wiki.example.com/gpu/shared-svc-runbooks",
    ),
    "prometheusRule.disabled": (
        "prometheusRule.enabled=true",
        "prometheusRule.disabled.SharedSvcLeaseErrors=true",
    ),
    "prometheusRule.for": (
        "prometheusRule.enabled=true",
        "prometheusRule.for.SharedSvcReconcileStale=10m",
    ),
    "prometheusRule.alertAnnotations": (
        "prometheusRule.enabled=true",
        "prometheusRule.alertAnnotations.dashboard=https://grafana.example.com/d/shared-svc",
    ),
    "prometheusRule.keepFiringFor": (
        "prometheusRule.enabled=true",
        "prometheusRule.keepFiringFor=10m",
    ),
    "prometheusRule.apiServerFailOpen": (
        "prometheusRule.enabled=true",
        "prometheusRule.apiServerFailOpen.enabled=true",
        "prometheusRule.apiServerFailOpen.job=kube-apiserver",
    ),
    "grafanaDashboard.enabled": ("grafanaDashboard.enabled=true",),
    "grafanaDashboard.labels": (
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.labels.team=gpu",
    ),
    "grafanaDashboard.annotations": (
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.annotations.grafana_folder=GPU",
    ),
    "grafanaDashboard.namespace": (
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.namespace=monitoring",
    ),
    "prometheusRule.labels": ("prometheusRule.enabled=true", "prometheusRule.labels.release=prom"),
    "prometheusRule.alertLabels": (
        "prometheusRule.enabled=true",
        "prometheusRule.alertLabels.team=gpu",
    ),
    "networkPolicy.enabled": ("networkPolicy.enabled=true",),
    "networkPolicy.metricsFrom": (
        "networkPolicy.enabled=true",
        "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
    ),
    "networkPolicy.webhookFrom": (
        "networkPolicy.enabled=true",
        "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/8",
    ),
}
# top-level values of the conventions; these hold free-form Kubernetes objects (one leaf each)
CONVENTION_KEYS = (
    "shutdownDelaySeconds",
    "nameOverride",
    "fullnameOverride",
    "namespaceOverride",
    "serviceAccount",
    "priorityClassName",
    "podLabels",
    "podAnnotations",
    "podSecurityContext",
    "securityContext",
    "affinity",
    "nodeSelector",
    "tolerations",
    "topologySpreadConstraints",
    "extraEnv",
    "hooks",
    "extraObjects",
    "prometheusRule",
    "grafanaDashboard",
    "networkPolicy",
)
OPAQUE = {"podSecurityContext", "securityContext", "affinity", "nodeSelector"}
# every convention value at once (the serviceAccount.create case names its account; an
# extra object is the user's, without the chart's labels)
ALL_CONVENTIONS = tuple(
    dict.fromkeys(
        s
        for key, sets in CONVENTION_CASES.items()
        if key not in ("serviceAccount.name", "extraObjects")
        for s in sets
    )
)
STANDARD_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)


def convention_leaves(values: dict[str, Any]) -> set[str]:
    out = {"image.digest"}
    for key in CONVENTION_KEYS:
        value = values[key]
        if isinstance(value, dict) and value and key not in OPAQUE:
            out |= {f"{key}.{k}" for k in value}
        else:
            out.add(key)
    return out


def test_every_convention_value_renders_and_changes_the_output() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert convention_leaves(values) == set(CONVENTION_CASES)
    default = render()
    for key, sets in CONVENTION_CASES.items():
        assert render(*sets) != default, f"{key}: no effect"
    for key in (
        "prometheusRule.labels",
        "prometheusRule.alertLabels",
        "prometheusRule.release",
        "prometheusRule.job",
        "prometheusRule.runbookBaseUrl",
        "prometheusRule.disabled",
        "prometheusRule.for",
        "prometheusRule.alertAnnotations",
        "prometheusRule.keepFiringFor",
        "prometheusRule.apiServerFailOpen",
        "grafanaDashboard.labels",
        "grafanaDashboard.annotations",
        "grafanaDashboard.namespace",
        "networkPolicy.metricsFrom",
    ):
        sets = CONVENTION_CASES[key]
        assert render(*sets) != render(sets[0]), f"{key}: no effect"
    # all at once: renders, the same every time (no lookup, nothing random)
    assert render(*ALL_CONVENTIONS) == render(*ALL_CONVENTIONS)


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ALL_CONVENTIONS,
        (*UPGRADE_ON, "serviceMonitor.enabled=true"),
        PLAIN_SETS,
        ("admission.certificate.source=serviceCA", "admission.mutation=webhook"),
    ],
    ids=["defaults", "every-new-value", "upgrade-servicemonitor", "plain-manifests", "openshift"],
)
def test_helm_lint_passes(sets: tuple[str, ...]) -> None:
    proc = lint(*sets)
    assert proc.returncode == 0, f"helm lint --strict failed:\n{proc.stdout}{proc.stderr}"
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert not [
        line for line in proc.stdout.splitlines() if line.startswith(("[WARNING]", "[ERROR]"))
    ]


def test_helm_lint_can_fail() -> None:
    proc = lint("replicas=0")
    assert proc.returncode == 1 and "[ERROR]" in proc.stdout and "replicas" in proc.stdout


@pytest.mark.parametrize(
    "sets", [(), ALL_CONVENTIONS, (*UPGRADE_ON, "serviceMonitor.enabled=true")]
)
def test_every_object_carries_the_standard_labels(sets: tuple[str, ...]) -> None:
    docs = render_docs(*sets)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for doc in docs:
        labels = doc["metadata"].get("labels") or {}
        missing = [k for k in STANDARD_LABELS if k not in labels]
        assert not missing, f"{doc['kind']}/{doc['metadata']['name']}: {missing}"
        assert labels["helm.sh/chart"] == f"{chart['name']}-{chart['version']}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == chart["appVersion"]


def test_name_overrides_rename_every_object_and_keep_the_references() -> None:
    docs = render_docs("nameOverride=dcgm-shared", name="gpu")
    deploy = one(docs, "Deployment", "gpu-dcgm-shared")
    assert deploy["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "dcgm-shared"
    full = render_docs("fullnameOverride=gpu-shared", name="whatever")
    names = {d["metadata"]["name"] for d in full}
    assert all(n.startswith("gpu-shared") for n in names), names
    pod = one(full, "Deployment", "gpu-shared")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-shared"
    assert pod["volumes"][0]["secret"]["secretName"] == "gpu-shared-webhook-tls"
    assert roles_of(full, "gpu-shared") == {
        ("Role", "gpu-shared", "gpu-operator"),
        ("Role", "gpu-shared-cluster-events", "default"),
        ("ClusterRole", "gpu-shared", ""),
    }
    webhook = one(full, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    assert webhook["service"]["name"] == "gpu-shared-webhook"
    assert one(full, "Service", "gpu-shared-webhook")


def test_service_account_block() -> None:
    docs = render_docs("serviceAccount.annotations.example\\.com/role=svc")
    assert one(docs, "ServiceAccount", "shared-svc")["metadata"]["annotations"] == {
        "example.com/role": "svc"
    }
    named = render_docs("serviceAccount.name=svc-identity")
    assert one(named, "ServiceAccount", "svc-identity")
    assert roles_of(named, "svc-identity") == roles_of(docs, "shared-svc")
    existing = render_docs("serviceAccount.create=false", "serviceAccount.name=existing")
    assert not find(existing, "ServiceAccount", "existing") and not find(
        existing, "ServiceAccount", "shared-svc"
    )
    pod = one(existing, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"
    assert roles_of(existing, "existing") == roles_of(docs, "shared-svc")
    # the admission hook Jobs keep ServiceAccounts, roles and bindings of their own
    for account in ("shared-svc-certs", "shared-svc-guard-remove"):
        assert one(existing, "ServiceAccount", account)
        assert roles_of(existing, account) == roles_of(docs, account) != set()
    assert {j["spec"]["template"]["spec"]["serviceAccountName"] for j in find(existing, "Job")} == {
        "shared-svc-certs",
        "shared-svc-guard-remove",
    }
    with pytest.raises(
        RenderError, match=r"serviceAccount\.create=false needs serviceAccount\.name"
    ):
        render("serviceAccount.create=false")


def pods(docs: list[Doc]) -> list[Doc]:
    """The pod specs of the Deployment and the hook Jobs."""
    return [d["spec"]["template"]["spec"] for d in find(docs, "Deployment") + find(docs, "Job")]


def test_image_digest_wins_over_the_tag() -> None:
    tagged = render_docs("image.repository=reg/shared-svc", "image.tag=9.9.9")
    assert {c["image"] for p in pods(tagged) for c in p["containers"]} == {"reg/shared-svc:9.9.9"}
    pinned = render_docs(
        "image.repository=reg/shared-svc", "image.tag=9.9.9", f"image.digest={DIGEST}"
    )
    assert {c["image"] for p in pods(pinned) for c in p["containers"]} == {
        f"reg/shared-svc@{DIGEST}"
    }
    with pytest.raises(RenderError, match="digest"):
        render("image.digest=latest")


def test_shutdown_delay_is_a_prestop_sleep_inside_the_grace_period() -> None:
    def pod_of(*sets: str) -> dict[str, Any]:
        spec: dict[str, Any] = one(render_docs(*sets), "Deployment")["spec"]["template"]["spec"]
        return spec

    default = pod_of()
    longer = pod_of("shutdownDelaySeconds=20")
    assert longer["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 20}}}
    assert (
        longer["terminationGracePeriodSeconds"] - default["terminationGracePeriodSeconds"] == 15
    ), "the delay adds to the grace period: the drain and the release keep their time"
    none = pod_of("shutdownDelaySeconds=0")
    assert "lifecycle" not in none["containers"][0], "0: no hook (a zero sleep needs 1.33's gate)"
    assert none["terminationGracePeriodSeconds"] == 45
    with pytest.raises(RenderError, match="shutdownDelaySeconds"):
        render("shutdownDelaySeconds=-1")


def test_pod_placement_and_security_values_reach_every_pod() -> None:
    docs = render_docs(*ALL_CONVENTIONS)
    for pod in pods(docs):
        assert pod["priorityClassName"] == "system-node-critical"
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "example.com/pool": "system"}
        assert pod["tolerations"] == [
            {
                "key": "node-role.kubernetes.io/control-plane",
                "operator": "Exists",
                "effect": "NoSchedule",
            }
        ]
        assert pod["securityContext"]["fsGroup"] == 65532
        assert pod["securityContext"]["runAsNonRoot"] is True, "a --set merges with the defaults"
        assert "runAsUser" not in pod["securityContext"]
        (container,) = pod["containers"]
        assert container["securityContext"]["privileged"] is False
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    deploy = one(docs, "Deployment")["spec"]["template"]
    assert set(deploy["spec"]["affinity"]) == {"nodeAffinity"}, "affinity replaces the default"
    assert deploy["metadata"]["labels"]["team"] == "gpu"
    assert deploy["metadata"]["annotations"] == {"example.com/owner": "gpu"}
    # the default affinity spreads the replicas; podLabels cannot move the selector
    default = render_docs("podLabels.app\\.kubernetes\\.io/name=other")
    template = one(default, "Deployment")["spec"]["template"]
    assert set(template["spec"]["affinity"]) == {"podAntiAffinity"}
    selector = one(default, "Deployment")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()


def documented_alerts() -> dict[str, tuple[str, str, str]]:
    """docs/operations.md's "Alerts" table: name -> (its expression's first code span, for,
    severity)."""
    import re

    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (\w+) \| (\w+) \|$", section, re.M)
    return {
        name: (re.findall(r"`([^`]+)`", expr)[0].replace("\\|", "|"), for_, severity)
        for name, expr, for_, severity in rows
    }


def bare(expr: str) -> str:
    """An expression without its label matchers, in one line."""
    import re

    return " ".join(re.sub(r"\{[^}]*\}", "", expr).split())


def test_prometheus_rule_has_the_documented_alerts_only_when_enabled() -> None:
    from tests.markdown import anchors

    assert not find(render_docs(), "PrometheusRule")
    documented = documented_alerts()
    assert len(documented) == 18
    docs = render_docs(
        "prometheusRule.enabled=true",
        "prometheusRule.labels.team=gpu-ops",
        "prometheusRule.alertLabels.team=gpu",
        *UPGRADE_ON,
        namespace="ops",
    )
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["namespace"] == "ops"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["team"] == "gpu-ops"
    alerts = rule["spec"]["groups"][0]["rules"]
    assert [a["alert"] for a in alerts] == list(documented)
    sections = anchors((REPO / "docs" / "operations.md").read_text())
    for alert in alerts:
        expr, for_, severity = documented[alert["alert"]]
        # the documented expression, pinned to the namespace and the job by label matchers
        # (the exporters' targets, in whatever job: to the namespace)
        pin = (
            ""
            if alert["alert"] == "SharedSvcExporterScrapedTwice"
            else ', job="shared-svc-metrics"'
        )
        assert f'namespace="ops"{pin}' in alert["expr"]
        assert bare(expr) in bare(alert["expr"]), (expr, alert["expr"])
        assert (alert["for"], alert["labels"]["severity"]) == (for_, severity)
        assert alert["labels"]["team"] == "gpu"
        assert alert["annotations"]["runbook_url"] == (
            f"https://git.example.com/shared-svc/blob/v0.1.0/docs/operations.md"
            f"#{alert['alert'].lower()}"
        )
        assert alert["alert"].lower() in sections
        assert alert["annotations"]["summary"] and "ops" in alert["annotations"]["description"]
    stale = next(a for a in alerts if a["alert"] == "SharedSvcReconcileStale")
    assert (
        'leader_election_master_status{namespace="ops", job="shared-svc-metrics", name="shared-svc"}'
        in stale["expr"]
    )


@pytest.mark.parametrize(
    ("sets", "missing"),
    [
        (
            (),
            {
                "SharedSvcUpgradeEvictionBlocked",
                "SharedSvcUpgradeConsumersNotLeaving",
                "SharedSvcUpgradeFailedNodes",
                "SharedSvcUpgradeReconcileErrors",
                "SharedSvcUpgradeGateMissing",
            },
        ),
        (
            ("controllers.services=false", *UPGRADE_ON),
            {
                "SharedSvcConfigConflicts",
                "SharedSvcConflictingWriter",
                "SharedSvcReconcileStale",
                "SharedSvcInvalidSpec",
                "SharedSvcDuplicateScrapeTarget",
                "SharedSvcExporterScrapedTwice",
                "SharedSvcAdmissionGuardNotServed",
                "SharedSvcAdmissionGuardMissing",
                "SharedSvcWebhookCertificateExpiry",
                "SharedSvcAdmissionGuardFailsOpen",
            },
        ),
        (
            ("replicas=1", "leaderElection.enabled=false", *UPGRADE_ON),
            {"SharedSvcLeaseErrors", "SharedSvcNoLeader"},
        ),
        (
            ("prometheusRule.disabled.SharedSvcConfigConflicts=true", *UPGRADE_ON),
            {"SharedSvcConfigConflicts"},
        ),
    ],
    ids=["services-only", "upgrade-only", "no-leader-election", "one-switched-off"],
)
def test_an_alert_is_rendered_only_where_its_metric_exists_and_not_when_switched_off(
    sets: tuple[str, ...], missing: set[str]
) -> None:
    rule = one(render_docs("prometheusRule.enabled=true", *sets), "PrometheusRule")
    names = {a["alert"] for a in rule["spec"]["groups"][0]["rules"]}
    assert names == set(documented_alerts()) - missing
    stale = [
        a for a in rule["spec"]["groups"][0]["rules"] if a["alert"] == "SharedSvcReconcileStale"
    ]
    if "leaderElection.enabled=false" in sets:
        assert "leader_election_master_status" not in stale[0]["expr"]


def test_a_misspelt_alert_or_a_bad_release_is_refused() -> None:
    with pytest.raises(RenderError, match="invalid propertyName 'SharedSvcLeaseError'"):
        render("prometheusRule.enabled=true", "prometheusRule.disabled.SharedSvcLeaseError=true")
    with pytest.raises(RenderError, match="release"):
        render("prometheusRule.release=not a label")


def test_the_release_label_and_its_override() -> None:
    docs = render_docs("prometheusRule.enabled=true", "serviceMonitor.enabled=true")
    for kind in ("PrometheusRule", "ServiceMonitor"):
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    docs = render_docs(
        "prometheusRule.enabled=true",
        "prometheusRule.release=prom",
        "serviceMonitor.enabled=true",
        "serviceMonitor.release=",
        "serviceMonitor.labels.release=from-labels",
    )
    assert one(docs, "PrometheusRule")["metadata"]["labels"]["release"] == "prom"
    assert one(docs, "ServiceMonitor")["metadata"]["labels"]["release"] == "from-labels"
    bare_ = render_docs("prometheusRule.enabled=true", "prometheusRule.release=")
    assert "release" not in one(bare_, "PrometheusRule")["metadata"]["labels"]


DASHBOARD = CHART / "dashboards" / "shared-svc.json"


def test_the_dashboard_configmap_is_the_plain_json_only_when_enabled() -> None:
    import json

    assert not find(render_docs(), "ConfigMap")
    docs = render_docs(
        "grafanaDashboard.enabled=true",
        "grafanaDashboard.namespace=monitoring",
        "grafanaDashboard.annotations.grafana_folder=GPU",
    )
    cm = one(docs, "ConfigMap", "shared-svc-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU"}
    assert cm["data"] == {"shared-svc.json": DASHBOARD.read_text().rstrip("\n")}
    dashboard = json.loads(cm["data"]["shared-svc.json"])
    assert dashboard["uid"] == "shared-svc" and dashboard["panels"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {
        "datasource",
        "cluster",
        "namespace",
        "job",
    }
    default_ns = one(render_docs("grafanaDashboard.enabled=true"), "ConfigMap")
    assert default_ns["metadata"]["namespace"] == "gpu-operator"


def test_network_policy_admits_the_endpoints_only_when_enabled() -> None:
    assert not find(render_docs(), "NetworkPolicy")
    docs = render_docs(*CONVENTION_CASES["networkPolicy.metricsFrom"])
    policy = one(docs, "NetworkPolicy")
    deploy = one(docs, "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = {p["name"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]}
    metrics, webhook = policy["spec"]["ingress"]
    assert metrics["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert metrics["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert webhook == {"ports": [{"port": "webhook", "protocol": "TCP"}]}, "from anywhere"
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == ports
    # no webhook served in the cluster: only the http port
    off = render_docs("networkPolicy.enabled=true", "admission.webhook.enabled=false")
    assert [r["ports"] for r in one(off, "NetworkPolicy")["spec"]["ingress"]] == [
        [{"port": "http", "protocol": "TCP"}]
    ]


def test_alert_annotations_keep_firing_for_and_an_alert_s_for_are_values() -> None:
    """kube-prometheus-stack's additionalRuleAnnotations and keepFiringFor, and a `for:` of
    one's own (issue 46); an alert's own annotations win."""
    rule = one(
        render_docs(
            "prometheusRule.enabled=true",
            "prometheusRule.alertAnnotations.dashboard=https://grafana.example.com/d/x",
            "prometheusRule.alertAnnotations.summary=not this",
            "prometheusRule.keepFiringFor=10m",
            "prometheusRule.for.SharedSvcReconcileStale=20m",
            "tuning.resyncSeconds=60",
        ),
        "PrometheusRule",
    )
    alerts = {a["alert"]: a for a in rule["spec"]["groups"][0]["rules"]}
    for alert in alerts.values():
        assert alert["keep_firing_for"] == "10m"
        assert alert["annotations"]["dashboard"] == "https://grafana.example.com/d/x"
        assert alert["annotations"]["summary"] != "not this"
    stale = alerts["SharedSvcReconcileStale"]
    assert stale["for"] == "20m" and alerts["SharedSvcLeaseErrors"]["for"] == "10m"
    # three resyncs of 60 s
    assert "shared_svc_last_successful_reconcile_timestamp_seconds{" in stale["expr"]
    assert "} > 180)" in stale["expr"] and "180 s" in stale["annotations"]["description"]
    plain = one(render_docs("prometheusRule.enabled=true"), "PrometheusRule")
    assert all("keep_firing_for" not in a for a in plain["spec"]["groups"][0]["rules"])


# --- the conventions of gpu-operator's, cert-manager's and prometheus-community's charts
# (issue 47) ---
def every_pod(docs: list[Doc]) -> list[Doc]:
    """The pod specs of the Deployment, the hook Jobs and the `helm test` Pod."""
    return pods(docs) + [d["spec"] for d in find(docs, "Pod")]


def test_every_pod_defaults_to_a_critical_class_linux_nodes_and_the_platform_s_uid() -> None:
    docs = render_docs()
    assert {d["metadata"]["name"] for d in find(docs, "Pod")} == {"shared-svc-test-admission-guard"}
    specs = every_pod(docs)
    assert len(specs) == 5, "Deployment, certs-pre, certs-post, guard-remove, test Pod"
    for pod in specs:
        # a preempted replica reopens the fight over the Services, a preempted leader
        # stalls the driver upgrade (docs/decisions.md)
        assert pod["priorityClassName"] == "system-cluster-critical"
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
        # the UID is the platform's: no runAsUser/runAsGroup anywhere in the pod
        for context in [pod["securityContext"]] + [c["securityContext"] for c in pod["containers"]]:
            assert not {"runAsUser", "runAsGroup"} & set(context), context
            assert context["runAsNonRoot"] is True
    # the plain manifests too
    for filename in PLAIN:
        text = (MANIFESTS / filename).read_text()
        assert "runAsUser" not in text and "runAsGroup" not in text, filename
    # a fixed UID is one value away; an empty class, none
    fixed = render_docs("podSecurityContext.runAsUser=65532", "priorityClassName=")
    for pod in every_pod(fixed):
        assert pod["securityContext"]["runAsUser"] == 65532
        assert "priorityClassName" not in pod


def test_topology_spread_constraints_are_a_value_with_the_pods_selector() -> None:
    default = one(render_docs(), "Deployment")["spec"]["template"]["spec"]
    selector = {"matchLabels": one(render_docs(), "Deployment")["spec"]["selector"]["matchLabels"]}
    assert default["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
        }
    ]
    zones = one(render_docs(*CONVENTION_CASES["topologySpreadConstraints"]), "Deployment")
    assert zones["spec"]["template"]["spec"]["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": selector,
        }
    ], "the zone example replaces the default and gets the pods' selector"
    own = one(
        render_docs(
            *CONVENTION_CASES["topologySpreadConstraints"],
            "topologySpreadConstraints[0].labelSelector.matchLabels.tier=gpu",
        ),
        "Deployment",
    )
    (constraint,) = own["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert constraint["labelSelector"] == {"matchLabels": {"tier": "gpu"}}, "a selector given stays"
    with pytest.raises(RenderError, match="topologyKey"):
        render("topologySpreadConstraints[0].maxSkew=1")


def test_extra_env_follows_the_chart_s_and_cannot_replace_a_setting() -> None:
    container = one(render_docs(*CONVENTION_CASES["extraEnv"]), "Deployment")["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert container["env"][-1] == {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}
    assert (
        container["env"][:-1]
        == one(render_docs(), "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    )
    for name in ("SHARED_SVC_PORT", "POD_NAME", "SHARED_SVC_WEBHOOK_PORT"):
        with pytest.raises(RenderError, match=f"extraEnv: {name} is set by the chart"):
            render(f"extraEnv[0].name={name}", "extraEnv[0].value=1")
    with pytest.raises(RenderError, match="name"):
        render("extraEnv[0].value=1")


def test_extra_objects_are_rendered_as_templates(tmp_path: Path) -> None:
    values = tmp_path / "extra.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "extraObjects": [
                    {
                        "apiVersion": "v1",
                        "kind": "ConfigMap",
                        "metadata": {
                            "name": '{{ include "shared-svc.fullname" . }}-extra',
                            "namespace": "{{ .Release.Namespace }}",
                        },
                        "data": {"replicas": "{{ .Values.replicas }}"},
                    },
                    "apiVersion: v1\nkind: ResourceQuota\nmetadata:\n"
                    "  name: {{ .Release.Name }}-critical-pods\n"
                    "spec:\n  scopeSelector:\n    matchExpressions:\n"
                    "      - {operator: In, scopeName: PriorityClass,"
                    " values: [{{ .Values.priorityClassName }}]}\n",
                ]
            }
        )
    )
    flags = ("-f", str(values))
    docs = render_docs(name="gpu", flags=flags)
    extra = one(docs, "ConfigMap", "gpu-shared-svc-extra")
    assert extra["metadata"]["namespace"] == "gpu-operator" and extra["data"] == {"replicas": "2"}
    quota = one(docs, "ResourceQuota", "gpu-critical-pods")
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == [
        "system-cluster-critical"
    ]
    assert render(name="gpu", flags=flags) == render(name="gpu", flags=flags)
    assert not find(render_docs(), "ResourceQuota")


def test_hook_pods_take_the_hook_resources() -> None:
    default = render_docs()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    hooks = [p for p in every_pod(default) if p["containers"][0]["name"] != "shared-svc"]
    assert len(hooks) == 4
    for pod in hooks:
        assert pod["containers"][0]["resources"] == values["hooks"]["resources"]
    for pod in every_pod(render_docs(*CONVENTION_CASES["hooks.resources"])):
        if pod["containers"][0]["name"] != "shared-svc":
            assert pod["containers"][0]["resources"]["limits"] == {"memory": "256Mi"}


def hook_annotations(doc: Doc) -> tuple[str, str]:
    annotations = doc["metadata"].get("annotations") or {}
    return annotations.get("helm.sh/hook", ""), annotations.get("argocd.argoproj.io/hook", "")


@pytest.mark.parametrize("sets", [(), ("admission.mutation=policy",)])
def test_argo_cd_s_pre_delete_hook_stands_beside_helm_s(sets: tuple[str, ...]) -> None:
    docs = render_docs(*sets)
    pre_delete = [d for d in docs if "pre-delete" in hook_annotations(d)[0].split(",")]
    assert {d["kind"] for d in pre_delete} >= {"Job", "ServiceAccount", "ClusterRole"}
    for doc in docs:
        helm_hook, argo_hook = hook_annotations(doc)
        # Argo CD runs no Helm pre-delete hook; every other hook it maps from Helm's own
        # (pre-install -> PreSync, ...), so only the pre-delete objects carry its annotation
        assert (argo_hook == "PreDelete") == ("pre-delete" in helm_hook.split(",")), doc["metadata"]
        if argo_hook:
            assert doc["metadata"]["annotations"]["argocd.argoproj.io/hook-delete-policy"] == (
                "BeforeHookCreation,HookSucceeded"
            )


def test_chart_metadata_for_artifact_hub() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in ("home", "icon"):
        assert chart[key].startswith("https://"), key
    assert chart["sources"] and all(s.startswith("https://") for s in chart["sources"])
    assert chart["maintainers"] and all(m["name"] for m in chart["maintainers"])
    notes = chart["annotations"]
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'license = "{notes["artifacthub.io/license"]}"' in pyproject
    images = yaml.safe_load(notes["artifacthub.io/images"])
    assert images == [
        {
            "name": "shared-svc",
            "image": f"{values['image']['repository']}:{chart['appVersion']}",
        }
    ], "the image the chart's defaults run"
    for link in yaml.safe_load(notes["artifacthub.io/links"]):
        assert link["url"].startswith(chart["home"]), link
    assert all(c["kind"] in ("added", "changed", "fixed", "removed", "security", "deprecated")
               for c in yaml.safe_load(notes["artifacthub.io/changes"]))  # fmt: skip
    assert (
        notes["artifacthub.io/prerelease"]
        == str("-" in chart["version"] or chart["version"].startswith("0.")).lower()
    )
