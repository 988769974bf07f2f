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
    _common,
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


def add_parser(commands: Any) -> None:
    """``upgrade prepare-daemonset``, a subcommand of ``commands``."""
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

    live = await _read_touchable(api, config, namespace, name)
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
    print(
        f"dry run: the API server accepted the change; DaemonSet {namespace}/{name} not changed"
        if dry_run
        else f"DaemonSet {namespace}/{name} prepared: its pods leave nodes labelled {key}, and "
        f"carry {shown} so the upgrade flow's gate waits for them (one rollout now)"
    )
    return 0


async def _read_touchable(
    api: ApiClient, config: Config, namespace: str, name: str
) -> dict[str, Any]:
    """The DaemonSet, read; a usage error where it is none or one of gpu-operator's
    operands (in the operator namespace, or by its node selector)."""
    from shared_svc.controllers.upgrade import io as upgrade_io

    if namespace == config.namespace:
        raise UsageError(
            f"{namespace} is the operator namespace: its DaemonSets are gpu-operator operands, never touched"
        )
    live = await upgrade_io.read_daemonset(api, namespace, name)
    if live is None:
        raise UsageError(f"DaemonSet {namespace}/{name} not found")
    operand_key = _operand_key(live)
    if operand_key is not None:
        raise UsageError(
            f"DaemonSet {namespace}/{name} is a gpu-operator operand ({operand_key}); not touched"
        )
    return live


def _operand_key(daemonset: dict[str, Any]) -> str | None:
    """The first node-selector key that makes a DaemonSet one of gpu-operator's operands
    (``nvidia.com/gpu.deploy.*`` but the client hook); None: not an operand."""
    spec = daemonset.get("spec", {}).get("template", {}).get("spec", {})
    selector = spec.get("nodeSelector") or {}
    keys = sorted(
        k
        for k in selector
        if k.startswith(_PROTECTED_KEY_PREFIX) and k != "nvidia.com/gpu.deploy.client"
    )
    return keys[0] if keys else None
