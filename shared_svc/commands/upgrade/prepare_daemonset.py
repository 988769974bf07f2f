"""``shared-svc upgrade prepare-daemonset NAMESPACE/NAME`` (the package's docstring says
what it does)."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import TYPE_CHECKING, Any

import yaml

from shared_svc.commands.upgrade.common import (
    _PROTECTED_KEY_PREFIX,
    _consumer_labels,
    _retrying_conflicts,
    _run,
)
from shared_svc.config import Config
from shared_svc.errors import UsageError
from shared_svc.k8s.labels import is_object_name

if TYPE_CHECKING:  # kubernetes_asyncio is imported only by the commands that connect
    from kubernetes_asyncio.client import ApiClient


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
