"""``shared-svc upgrade``: opt DaemonSets in to parking, set the upgrade flow's gate, show upgrading nodes.

``prepare-daemonset NAMESPACE/NAME`` adds the required node affinity term
``nvidia.com/<driver>-driver-upgrade.parked DoesNotExist`` to the DaemonSet's pod
template once (to every required term: they are ORed) and the declared consumer label
to its pod template labels (so its parked pods hold the gate), shows the change as a
unified diff and writes it in one patch (``--dry-run``: asks the API server to validate
it, writes nothing). It is the only change to a DaemonSet this tool ever makes, and it
causes one rollout.

``configure-gate`` prints the merge patch that sets ``waitForCompletion.podSelector`` of
the upgrade policy gpu-operator reads (``upgrade/policy.py``: the active ClusterPolicy's
``spec.driver.upgradePolicy`` in ClusterPolicy mode, each NVIDIADriver's
``spec.upgradePolicy`` in NVIDIADriver mode) to the declared consumer label (``--apply``:
applies it with the caller's kubeconfig; the service never writes it).

``status`` prints each upgrading (or still parked) node: its state, what the controller
recorded there (its record annotation: evicted, refused, blocked, or the restart-only
verdict) and what still holds the GPU. It reads what the service decided; it never
re-decides with local settings. It also lists the DaemonSets on gpu-operator's client hook
(``nvidia.com/gpu.deploy.client``): left to gpu-operator, never scheduled, or prepared both
ways; ``prepare-daemonset`` says the same of one and changes nothing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from shared_svc.config import Config, add_flags, flag_values, load, unknown_env
from shared_svc.errors import UsageError
from shared_svc.k8s.labels import is_object_name

if TYPE_CHECKING:  # kubernetes_asyncio is imported only by the commands that connect
    from kubernetes_asyncio.client import ApiClient

    from shared_svc.k8s.selectors import Selector
    from shared_svc.upgrade.daemonsets import ClientHookUse
    from shared_svc.upgrade.node_plan import NodeStatus
    from shared_svc.upgrade.policy import PolicySources, UpgradePolicy

T = TypeVar("T")

_PROTECTED_KEY_PREFIX = "nvidia.com/gpu.deploy."


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="driver-upgrade consumers: opt a DaemonSet in to parking; show upgrading nodes",
        description=__doc__,
    )
    commands = parser.add_subparsers(
        dest="upgrade_command", metavar="SUBCOMMAND", title="subcommands", required=True
    )

    prepare = commands.add_parser(
        "prepare-daemonset",
        help="add the parked-label node affinity and the consumer label to a DaemonSet (once)",
        description="Add the required node affinity term '<parked label> DoesNotExist' and "
        "the declared consumer label to a DaemonSet's pod template (one patch, one rollout).",
    )
    prepare.add_argument("target", metavar="NAMESPACE/NAME", help="the DaemonSet")
    prepare.add_argument(
        "--dry-run",
        action="store_true",
        help="show the diff and validate it server-side; write nothing",
    )
    _common(prepare)
    prepare.set_defaults(handler=prepare_daemonset)

    gate = commands.add_parser(
        "configure-gate",
        help="print (or --apply) the upgrade-policy change that makes the upgrade flow wait for the consumers",
        description="Print the merge patch that sets waitForCompletion.podSelector of the "
        "upgrade policy gpu-operator reads to the declared consumer label (and timeoutSeconds "
        "when it is 0), or apply it with --apply: the active ClusterPolicy's "
        "spec.driver.upgradePolicy in ClusterPolicy mode; each NVIDIADriver's "
        "spec.upgradePolicy in NVIDIADriver mode (spec.driver.useNvidiaDriverCRD, or no "
        "ClusterPolicy: a GPUCluster cluster). Run it with your own kubeconfig: the service "
        "never writes them.",
    )
    gate.add_argument(
        "--apply", action="store_true", help="apply the merge patch (default: print it only)"
    )
    gate.add_argument(
        "--nvidia-driver",
        action="append",
        metavar="NAME",
        help="NVIDIADriver mode: only this NVIDIADriver (repeatable; default: every one)",
    )
    gate.add_argument(
        "--replace",
        action="store_true",
        help="replace an existing podSelector that does not select the consumers (it is "
        "AND-only: first add the consumer label to the pods it gates today)",
    )
    gate.add_argument(
        "--timeout-seconds",
        type=int,
        default=None,
        metavar="N",
        help="waitForCompletion.timeoutSeconds to set when the policy has 0 (waits forever); "
        "a positive value in the policy is kept (default: 600)",
    )
    _common(gate)
    gate.set_defaults(handler=configure_gate)

    status = commands.add_parser(
        "status", help="upgrading nodes: state, what was freed, what still blocks"
    )
    status.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="output format"
    )
    _common(status)
    status.set_defaults(handler=show_status)


# The settings these commands read, as ``shared-svc run`` names them (shared_svc.config).
SETTINGS = ("kubeconfig", "namespace", "upgrade_driver_name", "upgrade_consumer_selector")


def _common(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SETTINGS)


def _config(args: argparse.Namespace) -> Config:
    """The service's settings: these flags over the environment over the defaults."""
    for warning in unknown_env(os.environ):
        print(f"shared-svc: warning: {warning}", file=sys.stderr)
    return load(flag_values(args, SETTINGS))


def _run(args: argparse.Namespace, body: Callable[[ApiClient, Config], Awaitable[T]]) -> T:
    """Connect, run ``body(api, config)``, close; API trouble is one line (``commands.api``)."""
    from shared_svc.commands.api import with_api

    config = _config(args)
    return with_api(config.kubeconfig, lambda api: body(api, config))


def _consumer_selector(config: Config) -> Selector:
    """The consumer selector ``Config`` parsed and checked (a bad one is a one-line error
    when the configuration is read)."""
    from shared_svc.upgrade.settings import UpgradeSettings

    return UpgradeSettings.from_config(config).consumer_selector


def _consumer_labels(config: Config) -> dict[str, str]:
    """The declared consumer label(s) of the consumer selector (one line when it has none)."""
    from shared_svc.upgrade.gate import NoConsumerLabel, consumer_labels

    try:
        return consumer_labels(_consumer_selector(config))
    except NoConsumerLabel as exc:
        raise UsageError(f"upgrade_consumer_selector: {exc}") from None


# Tries of a guarded patch when its object changed meanwhile (409): client-go's
# RetryOnConflict, five tries.
CONFLICT_TRIES = 5


async def _retrying_conflicts(once: Callable[[], Awaitable[int]], what: str) -> int:
    """``once()`` (read, plan, guarded patch) again after a 409, up to CONFLICT_TRIES times."""
    from kubernetes_asyncio.client.exceptions import ApiException

    for attempt in range(1, CONFLICT_TRIES + 1):
        try:
            return await once()
        except ApiException as exc:
            if exc.status != 409 or attempt == CONFLICT_TRIES:
                raise
            print(f"{what} changed meanwhile: planning again", file=sys.stderr)
    raise AssertionError("unreachable")


# --- prepare-daemonset ---


def parse_target(text: str) -> tuple[str, str]:
    namespace, sep, name = text.partition("/")
    if not sep or not is_object_name(namespace, label=True) or not is_object_name(name):
        raise UsageError(f"expected NAMESPACE/NAME of a DaemonSet, got {text!r}")
    return namespace, name


def _shown(daemonset: dict[str, Any]) -> str:
    """The DaemonSet as a user reads it: no status, managed fields or server bookkeeping."""
    meta = {
        k: v
        for k, v in daemonset.get("metadata", {}).items()
        if k not in ("managedFields", "resourceVersion", "generation", "uid", "creationTimestamp")
    }
    body = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta,
        "spec": daemonset.get("spec", {}),
    }
    return yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def diff_text(before: dict[str, Any], after: dict[str, Any], label: str) -> str:
    return "".join(
        difflib.unified_diff(
            _shown(before).splitlines(keepends=True),
            _shown(after).splitlines(keepends=True),
            fromfile=f"{label} (live)",
            tofile=f"{label} (prepared)",
        )
    )


def prepare_daemonset(args: argparse.Namespace) -> int:
    namespace, name = parse_target(args.target)

    async def body(api: ApiClient, config: Config) -> int:
        # The patch is guarded by the resourceVersion it was planned on, and the DaemonSet
        # controller writes the DaemonSet's status as its pods come and go: a 409 is
        # planned again from a fresh read, as configure-gate does.
        return await _retrying_conflicts(
            lambda: _prepare(api, config, namespace, name, dry_run=args.dry_run), "the DaemonSet"
        )

    return _run(args, body)


async def _prepare(
    api: ApiClient, config: Config, namespace: str, name: str, *, dry_run: bool
) -> int:
    """Read, plan and (guarded by resourceVersion) patch the DaemonSet once."""
    from shared_svc.controllers.upgrade import io as upgrade_io
    from shared_svc.upgrade.daemonsets import (
        classify_daemonset,
        client_hook_use,
        missing_template_labels,
        parked_label_key,
        with_parked_requirement,
        with_template_labels,
    )
    from shared_svc.upgrade.gate import label_text

    if namespace == config.namespace:
        raise UsageError(
            f"{namespace} is the operator namespace: its DaemonSets are gpu-operator operands, never touched"
        )
    live = await upgrade_io.read_daemonset(api, namespace, name)
    if live is None:
        raise UsageError(f"DaemonSet {namespace}/{name} not found")
    selector = live.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector") or {}
    operand_keys = sorted(
        k
        for k in selector
        if k.startswith(_PROTECTED_KEY_PREFIX) and k != "nvidia.com/gpu.deploy.client"
    )
    if operand_keys:
        raise UsageError(
            f"DaemonSet {namespace}/{name} is a gpu-operator operand ({operand_keys[0]}); not touched"
        )
    key = parked_label_key(config.upgrade_driver_name)
    hook = client_hook_use(live, key, await upgrade_io.client_label_on_nodes(api))
    if hook is not None and hook.finding == "never-schedules":
        raise UsageError(hook.message)
    if hook is not None:  # left to gpu-operator, or already prepared both ways
        print(("warning: " if hook.warns else "") + hook.message + " Nothing to do.")
        return 0
    labels = _consumer_labels(config)
    declared = classify_daemonset(live, key) == "declared"
    missing = missing_template_labels(live, labels)
    shown = label_text(labels)
    if declared and not missing:
        print(
            f"DaemonSet {namespace}/{name} already requires {key} DoesNotExist and its pods "
            f"carry {shown}: nothing to do"
        )
        return 0
    prepared = with_template_labels(
        live if declared else with_parked_requirement(live, key), missing
    )
    sys.stdout.write(diff_text(live, prepared, f"daemonset/{namespace}/{name}"))
    required = (
        None
        if declared
        else prepared["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
    )
    await upgrade_io.patch_daemonset_template(
        api, live, required=required, labels=missing, dry_run=dry_run
    )
    if dry_run:
        print(
            f"dry run: the API server accepted the change; DaemonSet {namespace}/{name} not changed"
        )
    else:
        print(
            f"DaemonSet {namespace}/{name} prepared: its pods leave nodes labelled {key}, and "
            f"carry {shown} so the upgrade flow's gate waits for them (one rollout now)"
        )
    return 0


# --- configure-gate ---


async def _list_if_served(api: ApiClient, path: str) -> list[dict[str, Any]]:
    """The objects of a custom resource; [] when its CRD is not installed (404)."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.kube.writer import raw_request

    try:
        data = await raw_request(api, "GET", path)
    except ApiException as exc:
        if exc.status == 404:
            return []
        raise
    return list(data.get("items") or [])


async def _list_cluster_policies(api: ApiClient) -> list[dict[str, Any]]:
    from shared_svc.controllers.shared_caches import CLUSTER_POLICIES

    return await _list_if_served(api, CLUSTER_POLICIES.gvr.collection())


async def _policy_sources(api: ApiClient) -> tuple[PolicySources, list[dict[str, Any]]]:
    """Which upgrade policies gpu-operator reads (``upgrade.policy``, as the service decides
    it), from the ClusterPolicies, the NVIDIADrivers and the NVIDIADriver CRD; and the
    NVIDIADrivers listed."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared_svc.controllers.upgrade.caches import NVIDIA_DRIVERS
    from shared_svc.kube.resources import CUSTOM_RESOURCE_DEFINITIONS
    from shared_svc.kube.writer import raw_request
    from shared_svc.upgrade.policy import NVIDIA_DRIVER_CRD, policy_sources, reads_driver_policy

    try:
        crd = await raw_request(api, "GET", CUSTOM_RESOURCE_DEFINITIONS.item(NVIDIA_DRIVER_CRD))
    except ApiException as exc:
        if exc.status != 404:
            raise
        crd = None
    drivers = await _list_if_served(api, NVIDIA_DRIVERS.gvr.collection()) if crd else []
    sources = policy_sources(
        await _list_cluster_policies(api), drivers, driver_policy=reads_driver_policy(crd)
    )
    return sources, drivers


def _gate_targets(sources: PolicySources, named: list[str]) -> tuple[UpgradePolicy, ...]:
    """The policies configure-gate writes: where gpu-operator reads the gate (every
    NVIDIADriver, or those ``named``, in NVIDIADriver mode; the ClusterPolicy in its mode)."""
    if sources.mode == "none":
        raise UsageError(
            f"{sources.why}: no upgrade policy gpu-operator reads; is gpu-operator installed?"
        )
    if sources.mode == "cluster-policy":
        if named:
            raise UsageError(
                f"{sources.why}: gpu-operator reads {sources.policies[0].where}'s upgrade "
                f"policy, not an NVIDIADriver's: run without --nvidia-driver"
            )
        return sources.policies
    if not sources.policies:
        raise UsageError(f"{sources.why}, and there is no NVIDIADriver: nothing reads a gate")
    known = {p.name: p for p in sources.policies}
    unknown = sorted(set(named) - known.keys())
    if unknown:
        raise UsageError(f"no NVIDIADriver {', '.join(unknown)} (there are: {', '.join(known)})")
    return tuple(p for p in sources.policies if not named or p.name in named)


def configure_gate(args: argparse.Namespace) -> int:
    from shared_svc.controllers.shared_caches import CLUSTER_POLICIES
    from shared_svc.controllers.upgrade.caches import NVIDIA_DRIVERS
    from shared_svc.kube.writer import MERGE_PATCH, raw_request
    from shared_svc.upgrade.gate import DEFAULT_GATE_TIMEOUT_SECONDS, plan_gate

    timeout = DEFAULT_GATE_TIMEOUT_SECONDS if args.timeout_seconds is None else args.timeout_seconds
    if timeout <= 0:
        raise UsageError(f"--timeout-seconds must be > 0, got {timeout}")
    named: list[str] = args.nvidia_driver or []

    async def body(api: ApiClient, config: Config) -> int:
        # Each patch is guarded by the resourceVersion it was planned on; gpu-operator writes
        # its ClusterPolicy and NVIDIADrivers too, so a 409 is planned again from a fresh
        # read (what was applied meanwhile then plans nothing).
        return await _retrying_conflicts(lambda: once(api, config), "an upgrade policy")

    async def once(api: ApiClient, config: Config) -> int:
        _consumer_labels(config)  # one line for a selector without a label
        sources, _ = await _policy_sources(api)
        targets = _gate_targets(sources, named)
        print(f"{sources.why}: the gate is read from {', '.join(p.where for p in targets)}")
        plans = [
            (
                policy,
                plan_gate(
                    policy,
                    _consumer_selector(config),
                    replace=args.replace,
                    timeout_seconds=timeout,
                ),
            )
            for policy in targets
        ]
        refused = [plan.message for _, plan in plans if plan.action == "refuse"]
        if refused:  # nothing is written while one of them needs the user first
            raise UsageError("; ".join(refused))
        for policy, plan in plans:
            print(plan.message)
            if plan.action == "nothing":
                continue
            patch = json.dumps(plan.patch, separators=(",", ":"))
            print(f"merge patch: {patch}")
            print(f"kubectl patch {policy.kind.lower()} {policy.name} --type merge -p '{patch}'")
            if not policy.auto_upgrade:
                print(
                    f"note: {policy.where}: auto-upgrade is off ({policy.off}): the gate "
                    "takes effect when it is on"
                )
        due = [(p, plan) for p, plan in plans if plan.action == "set"]
        if not due:
            return 0
        if not args.apply:
            print("not applied: run again with --apply, or run the kubectl command(s) above")
            return 0
        for policy, plan in due:
            resource = CLUSTER_POLICIES if policy.owner is None else NVIDIA_DRIVERS
            guarded = {**plan.patch, "metadata": {"resourceVersion": policy.resource_version}}
            await raw_request(
                api,
                "PATCH",
                resource.gvr.item(policy.name),
                body=guarded,
                content_type=MERGE_PATCH,
                query=[("fieldManager", "shared-svc-configure-gate")],
            )
            print(f"applied to {policy.where}")
        return 0

    return _run(args, body)


# --- status ---


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
