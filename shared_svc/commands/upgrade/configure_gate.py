"""``shared-svc upgrade configure-gate`` (the package's docstring says what it does)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from shared_svc.commands.upgrade.common import (
    _common,
    _consumer_labels,
    _consumer_selector,
    _retrying_conflicts,
    _run,
)
from shared_svc.config import Config
from shared_svc.errors import UsageError

if TYPE_CHECKING:  # kubernetes_asyncio is imported only by the commands that connect
    from kubernetes_asyncio.client import ApiClient

    from shared_svc.upgrade.gate import GatePlan
    from shared_svc.upgrade.policy import PolicySources, UpgradePolicy


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


def add_parser(commands: Any) -> None:
    """``upgrade configure-gate``, a subcommand of ``commands``."""
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


def configure_gate(args: argparse.Namespace) -> int:
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
        _print_plans(plans)
        due = [(p, plan) for p, plan in plans if plan.action == "set"]
        if not due:
            return 0
        if not args.apply:
            print("not applied: run again with --apply, or run the kubectl command(s) above")
            return 0
        await _apply(api, due)
        return 0

    return _run(args, body)


def _print_plans(plans: list[tuple[UpgradePolicy, GatePlan]]) -> None:
    """Each policy's plan: its message and, where it changes the policy, the merge patch
    and the kubectl command that applies it."""
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


async def _apply(api: ApiClient, due: list[tuple[UpgradePolicy, GatePlan]]) -> None:
    """The merge patches of ``due``, each guarded by the resourceVersion it was planned on."""
    from shared_svc.controllers.shared_caches import CLUSTER_POLICIES
    from shared_svc.controllers.upgrade.caches import NVIDIA_DRIVERS
    from shared_svc.kube.writer import MERGE_PATCH, raw_request

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
