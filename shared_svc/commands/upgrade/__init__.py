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

from typing import Any

# The modules (not their functions of the same names): each is an attribute of the package.
from shared_svc.commands.upgrade import configure_gate, prepare_daemonset, show_status
from shared_svc.commands.upgrade.common import _common


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
    prepare.set_defaults(handler=prepare_daemonset.prepare_daemonset)

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
    gate.set_defaults(handler=configure_gate.configure_gate)

    status = commands.add_parser(
        "status", help="upgrading nodes: state, what was freed, what still blocks"
    )
    status.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="output format"
    )
    _common(status)
    status.set_defaults(handler=show_status.show_status)
