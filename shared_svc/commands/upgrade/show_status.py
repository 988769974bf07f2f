"""``shared-svc upgrade status`` (the package's docstring says what it does)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from shared_svc.commands.upgrade.common import _common, _consumer_selector, _run
from shared_svc.commands.upgrade.configure_gate import _policy_sources
from shared_svc.config import Config

if TYPE_CHECKING:  # kubernetes_asyncio is imported only by the commands that connect
    from kubernetes_asyncio.client import ApiClient

    from shared_svc.upgrade.daemonsets import ClientHookUse
    from shared_svc.upgrade.node_plan import NodeStatus
    from shared_svc.upgrade.policy import PolicySources


async def gather_gate(
    api: ApiClient, config: Config, nodes: list[dict[str, Any]]
) -> tuple[dict[str, Any], PolicySources | None]:
    """The gates of the upgrade policies gpu-operator reads, checked against the consumer
    selector (the service's default or $SHARED_SVC_UPGRADE_CONSUMER_SELECTOR /
    --upgrade-consumer-selector): the same pure review the service makes (its verdicts are
    in its /status), each naming its nodes among ``nodes``; and the sources (None: not
    readable)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.controllers.upgrade.status import gate_json
    from shared_svc.upgrade.gate import review_gate

    try:
        sources, _ = await _policy_sources(api)
    except ApiException as exc:
        if exc.status != 403:
            raise
        return {
            "state": "unknown",
            "message": "cannot read the ClusterPolicies, NVIDIADrivers or their CRD (403): "
            "gate not checked",
        }, None
    return gate_json(review_gate(sources, _consumer_selector(config), nodes)), sources


async def _flow_nodes(api: ApiClient, config: Config) -> dict[str, Any]:
    """Every node that is upgrading or still parked, by name."""
    from shared_svc.controllers.upgrade import io as upgrade_io
    from shared_svc.controllers.upgrade.caches import node_resources

    nodes: dict[str, Any] = {}
    for resource in node_resources(config.upgrade_driver_name):
        assert resource.label_selector is not None
        for node in await upgrade_io.list_nodes(api, resource.label_selector):
            nodes[node["metadata"]["name"]] = node
    return nodes


async def gather_status(
    api: ApiClient,
    config: Config,
    nodes: dict[str, Any],
    sources: PolicySources | None = None,
) -> tuple[list[NodeStatus], tuple[ClientHookUse, ...]]:
    """The status of every node that is upgrading or still parked (``nodes``), from the
    service's record and the policy that governs it, and the DaemonSets on gpu-operator's
    client hook.

    Only the driver name (the label keys) comes from local configuration: the eviction
    timeout, selector and detection are the service's, and the record holds its decisions.
    """
    from shared_svc.controllers.upgrade import io as upgrade_io
    from shared_svc.upgrade.daemonsets import client_hook_uses, parked_label_key
    from shared_svc.upgrade.node_status import listed, recorded_status
    from shared_svc.upgrade.policy import GPU_OPERATOR_DRIVER

    driver = config.upgrade_driver_name
    daemonsets = await upgrade_io.list_daemonsets(api)
    hooks = client_hook_uses(
        daemonsets, parked_label_key(driver), await upgrade_io.client_label_on_nodes(api)
    )
    out: list[NodeStatus] = []
    for name in sorted(nodes):
        labels = nodes[name]["metadata"].get("labels") or {}
        flow = sources.flow(labels) if sources and driver == GPU_OPERATOR_DRIVER else None
        if not listed(recorded_status(nodes[name], (), (), driver, flow)):
            continue  # an idle node (upgrade-done, upgrade-required): no pods to read
        pods = await upgrade_io.pods_on_node(api, name)
        out.append(recorded_status(nodes[name], pods, daemonsets, driver, flow))
    return out, hooks


def _gate_line(gate: dict[str, Any]) -> str:
    """The gate review as text: the mode, then one line per verdict."""
    if "verdicts" not in gate:  # not checked
        return f"gate: {gate['message']}\n"
    lines = [f"gate: {gate['why']}"]
    for v in gate["verdicts"]:
        warns = v["state"] in ("missing", "mismatch", "invalid")
        governs = (
            f" [{v['governs']}: {v['nodeCount']} node(s) in the flow"
            + (f": {', '.join(v['nodes'])}" + (" ..." if v["nodeCount"] > len(v["nodes"]) else ""))
            * bool(v["nodes"])
            + "]"
            if v["policy"]
            else ""
        )
        lines.append(f"  {'WARNING: ' if warns else ''}{v['state']}: {v['message']}{governs}")
    for unread in gate["unread"]:
        lines.append(f"  not read by gpu-operator in this mode: {unread}")
    if gate["ungovernedCount"]:
        lines.append(
            f"  {gate['ungovernedCount']} node(s) in the flow governed by no policy (no flow "
            f"moves them): {', '.join(gate['ungoverned'])}"
        )
    return "\n".join(lines) + "\n"


def _text(statuses: list[NodeStatus]) -> str:
    if not statuses:
        return "no node is upgrading or parked\n"
    lines = []
    for s in (status.as_dict() for status in statuses):
        lines.append(
            f"{s['node']}: {s['state'] if s['state'] is not None else '(no state label)'} -> {s['phase']}"
        )
        if s["since"] is None and s["mode"] == "free" and not s["record_error"]:
            lines.append(
                "  nothing recorded yet: shared-svc has not acted on this node "
                "(not running, not leading, or dry-run: see its /status)"
            )
        if s["unknown_state"]:
            lines.append("  unknown upgrade state: treated as keep (nothing new is evicted)")
        if s["path"] == "restart-only":
            lines.append(
                f"  restart-only: the driver restarts in place (DaemonSet {s['driver_daemonset']}, "
                "DRIVER_CONFIG_DIGEST unchanged): nothing freed, nothing parked"
            )
        elif s["path_evidence"] == "guess":
            lines.append(
                "  path guessed: no evidence of restart-only or full in pod-restart-required; "
                "freed (the side that cannot stall a full upgrade)"
            )
        if s["since"] and s["path"] != "restart-only":
            parked = (
                "set by shared-svc"
                if s["parked_by_us"]
                else ("present, not ours" if s["parked_label"] else "absent")
            )
            lines.append(
                f"  since {s['since']}; parked label {parked}; freed at {s['freed_at'] or '-'}"
            )
        for title, key in (
            ("still on the node", "pending"),
            ("evicted (accepted; gone or terminating)", "evicted"),
            ("evicted, still terminating past the timeout", "stuck"),
            ("eviction refused (retried until the timeout)", "refused"),
            ("eviction refused past the timeout", "blocked"),
            ("declared DaemonSet pods still on the node", "daemonset_pods"),
            (
                "DaemonSets running declared consumers, not prepared (run prepare-daemonset)",
                "unprepared_daemonsets",
            ),
            ("detected, not declared (left running)", "detected"),
            ("left to gpu-operator (gpu.deploy.client)", "operator_hook_pods"),
            ("DaemonSets only partly declared", "partial_daemonsets"),
            (
                "freed consumers still here at pod-restart-required (the flow did not wait: see the gate)",
                "restart_race",
            ),
        ):
            if s[key]:
                lines.append(f"  {title}: {', '.join(s[key])}")
        if s["record_error"]:
            lines.append(f"  record annotation unreadable: {s['record_error']}")
    return "\n".join(lines) + "\n"


def _hooks_text(hooks: tuple[ClientHookUse, ...]) -> str:
    if not hooks:
        return ""
    lines = ["DaemonSets on gpu-operator's client hook (nvidia.com/gpu.deploy.client):"]
    lines += [f"  {'WARNING: ' if h.warns else ''}{h.message}" for h in hooks]
    return "\n".join(lines) + "\n"


def add_parser(commands: Any) -> None:
    """``upgrade status``, a subcommand of ``commands``."""
    status = commands.add_parser(
        "status", help="upgrading nodes: state, what was freed, what still blocks"
    )
    status.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="output format"
    )
    _common(status)
    status.set_defaults(handler=show_status)


def show_status(args: argparse.Namespace) -> int:
    async def body(
        api: ApiClient, config: Config
    ) -> tuple[dict[str, Any], tuple[list[NodeStatus], tuple[ClientHookUse, ...]]]:
        nodes = await _flow_nodes(api, config)
        gate, sources = await gather_gate(api, config, list(nodes.values()))
        return gate, await gather_status(api, config, nodes, sources)

    (gate, (statuses, hooks)) = _run(args, body)
    if args.output == "json":
        from shared_svc.controllers.upgrade.status import node_json  # the serializer of /status

        shown = {
            "gate": gate,
            "nodes": [node_json(s) for s in statuses],
            "clientHook": [h.as_dict() for h in hooks],
        }
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")
    else:
        sys.stdout.write(_gate_line(gate) + _text(statuses) + _hooks_text(hooks))
    return 0
