"""The one JSON serializer of the upgrade controller's status: ``/status`` (its
``upgrade`` part) and ``shared-svc upgrade status -o json`` spell a node's status and the
gate with the same keys, camelCased as Kubernetes spells JSON (``k8s.objects.camel_keys``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared_svc.k8s.objects import camel_keys
from shared_svc.upgrade.gate import GateVerdicts
from shared_svc.upgrade.node_plan import NodeStatus


def node_json(status: NodeStatus) -> dict[str, Any]:
    return camel_keys(status.as_dict())


def gate_json(gate: GateVerdicts) -> dict[str, Any]:
    """The mode, the summary state and one verdict per policy source gpu-operator reads."""
    shown = camel_keys(gate.as_dict())
    shown["verdicts"] = [camel_keys(v) for v in shown["verdicts"]]
    return shown


def nodes_json(statuses: Mapping[str, NodeStatus]) -> dict[str, dict[str, Any]]:
    return {name: node_json(statuses[name]) for name in sorted(statuses)}
