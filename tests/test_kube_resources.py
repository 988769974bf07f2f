"""``kube/resources.GVR``: the one way to build an API path (issue 11)."""

from __future__ import annotations

from shared_svc.controllers.shared_caches import CLUSTER_POLICIES
from shared_svc.kube.resources import (
    EVENTS,
    GVR,
    NODES,
    PODS,
    SECRETS,
    VALIDATING_WEBHOOKS,
    Resource,
)
from shared_svc.kube.writer import object_path


def test_core_and_group_paths() -> None:
    assert PODS.collection() == "/api/v1/pods"
    assert PODS.collection("gpu-operator") == "/api/v1/namespaces/gpu-operator/pods"
    assert PODS.item("p", "ml", "eviction") == "/api/v1/namespaces/ml/pods/p/eviction"
    assert NODES.item("node-1") == "/api/v1/nodes/node-1"
    assert SECRETS.item("tls", "ns") == "/api/v1/namespaces/ns/secrets/tls"
    assert EVENTS.item("e.1", "default") == "/apis/events.k8s.io/v1/namespaces/default/events/e.1"
    assert VALIDATING_WEBHOOKS.item("w") == (
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/w"
    )
    assert GVR("monitoring.coreos.com", "v1", "x").group_version == "/apis/monitoring.coreos.com/v1"


def test_a_segment_is_quoted() -> None:
    """A name never adds a path segment or a query (names come from objects and flags)."""
    assert NODES.item("a/b?c") == "/api/v1/nodes/a%2Fb%3Fc"


def test_caches_and_the_writer_build_their_paths_with_it() -> None:
    assert CLUSTER_POLICIES.path == "/apis/nvidia.com/v1/clusterpolicies"
    pods = Resource("", "v1", "pods", "Pod", namespace="gpu-operator")
    assert pods.path == PODS.collection("gpu-operator")
    assert object_path("Service", "ns", "s") == "/api/v1/namespaces/ns/services/s"
    assert object_path("ServiceMonitor", "ns") == (
        "/apis/monitoring.coreos.com/v1/namespaces/ns/servicemonitors"
    )
