"""Projections: the parts of an object the planners read, kept by the caches.

``daemonset_fields`` is read by both cores (the Services gate and the driver-upgrade
planner), so the one DaemonSet cache both controllers share keeps it.
"""

from __future__ import annotations

from typing import Any

from shared_svc.k8s.objects import K8sObject


def _pick(value: Any, keep: tuple[str, ...]) -> Any:
    """The ``keep`` keys of a dict, as they are; anything else (a wrong type) unchanged."""
    return {k: value[k] for k in keep if k in value} if isinstance(value, dict) else value


_DS_METADATA = ("name", "namespace", "uid", "generation", "labels", "resourceVersion")
_DS_STATUS = (
    "observedGeneration",
    "updatedNumberScheduled",
    "desiredNumberScheduled",
    "numberAvailable",
)


_DS_TEMPLATE_SPEC = ("affinity", "nodeSelector")
_DS_CONTAINERS = ("containers", "initContainers")
# The env gpu-operator sets on its driver pod template (a hash of what the driver install
# depends on); the driver-upgrade planner compares it with the driver pod's (upgrade/paths.py).
DRIVER_CONFIG_DIGEST = "DRIVER_CONFIG_DIGEST"

DAEMONSET_READS = {
    "apiVersion": None,
    "kind": None,
    "metadata": dict.fromkeys(_DS_METADATA),
    "status": dict.fromkeys(_DS_STATUS),
    "spec": {
        "selector": None,
        "updateStrategy": None,
        "template": {
            "metadata": {"labels": None},
            "spec": {
                **dict.fromkeys(_DS_TEMPLATE_SPEC),
                **{key: [{"env": None}] for key in _DS_CONTAINERS},
            },
        },
    },
}
"""What :func:`daemonset_fields` reads of a DaemonSet, as a shape (``kube.decode.Shape``:
None is a value whole): a cache decodes only these from the wire."""


def daemonset_fields(daemonset: K8sObject) -> K8sObject:
    """The parts of a DaemonSet that planning reads, as they are (wrong types included).

    For the Services gate (:func:`gate_open`): ``metadata`` name, namespace and
    generation, the pod template's labels and the four rollout counters of ``status``.
    For the driver-upgrade planner (``upgrade.daemonsets.index_daemonsets``): ``uid`` and
    the pod template's ``affinity`` and ``nodeSelector``; for its restart-only rule
    (``upgrade.paths``): the ``DRIVER_CONFIG_DIGEST`` env entries of the template's
    containers and init containers (:func:`_digest_entries`), with ``generation``. Labels, the selector and the
    update strategy are kept too (small, and what a reader of ``/status`` expects). The
    caches keep only these (one projection for the one DaemonSet cache both controllers
    share); proptests/test_projection_props.py proves the plans unchanged.
    """
    if not isinstance(daemonset, dict):
        return daemonset
    out: K8sObject = {k: daemonset[k] for k in ("apiVersion", "kind") if k in daemonset}
    if "metadata" in daemonset:
        out["metadata"] = _pick(daemonset["metadata"], _DS_METADATA)
    if "status" in daemonset:
        out["status"] = _pick(daemonset["status"], _DS_STATUS)
    if "spec" in daemonset:
        spec = daemonset["spec"]
        kept = _pick(spec, ("selector", "updateStrategy"))
        if isinstance(spec, dict) and "template" in spec:
            template = spec["template"]
            if isinstance(template, dict):
                template = {
                    **(
                        {"metadata": _pick(template["metadata"], ("labels",))}
                        if "metadata" in template
                        else {}
                    ),
                    **({"spec": _template_spec(template["spec"])} if "spec" in template else {}),
                }
            kept["template"] = template
        out["spec"] = kept
    return out


def _template_spec(spec: Any) -> Any:
    out = _pick(spec, _DS_TEMPLATE_SPEC)
    if isinstance(spec, dict):
        for key in _DS_CONTAINERS:
            kept = _digest_entries(spec.get(key))
            if kept:
                out[key] = kept
    return out


def _digest_entries(containers: Any) -> Any:
    """Of a container list, the containers that carry a ``DRIVER_CONFIG_DIGEST`` env entry,
    in order, each with those entries only (a value of another type is kept as it is): a
    driver DaemonSet keeps a few bytes, any other nothing (the key is left out)."""
    if containers is not None and not isinstance(containers, list):
        return containers
    out = []
    for container in containers or ():
        env = container.get("env") if isinstance(container, dict) else None
        if not isinstance(env, list):
            continue
        entries = [e for e in env if isinstance(e, dict) and e.get("name") == DRIVER_CONFIG_DIGEST]
        if entries:
            out.append({"env": entries})
    return out
