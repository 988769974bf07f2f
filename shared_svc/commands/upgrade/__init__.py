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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="driver-upgrade consumers: opt a DaemonSet in to parking; show upgrading nodes",
        description=__doc__,
    )
    commands = parser.add_subparsers(
        dest="upgrade_command", metavar="SUBCOMMAND", title="subcommands", required=True
    )

    prepare_daemonset.add_parser(commands)
    configure_gate.add_parser(commands)
    show_status.add_parser(commands)
