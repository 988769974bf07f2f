"""Which upgrade state means free, keep, restore or nothing.

States are the values of gpu-operator's node label ``nvidia.com/<driver>-driver-upgrade-state``
(k8s-operator-libs ``pkg/upgrade/consts.go``).
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["free", "keep", "restore", "nothing", "abort"]

# The node is committed to the upgrade and (from cordon-required on) cordoned: consumers
# displaced now reschedule elsewhere, and the driver is unloaded in pod-restart-required.
FREE_STATES = frozenset(
    {
        "cordon-required",
        "wait-for-jobs-required",
        "pod-deletion-required",
        "drain-required",
        "pod-restart-required",
    }
)
# The new driver is not proven yet (validation) or the upgrade failed (self-heals):
# restoring now could start consumers while the module is not loaded.
# k8s-operator-libs' requestor mode (NodeMaintenance objects of the Mellanox maintenance
# operator; gpu-operator passes StateOptions{}, so it is off there): the maintenance
# operator drains the node itself, so what was freed is kept and nothing new is freed.
REQUESTOR_STATES = frozenset({"node-maintenance-required", "post-maintenance-required"})
KEEP_STATES = (
    frozenset({"validation-required", "uncordon-required", "upgrade-failed"}) | REQUESTOR_STATES
)
RESTORE_STATES = frozenset({"upgrade-done"})
# Slot-gated, may last weeks or be skipped: never free here, and (contract, section 3)
# leave an existing record alone too: a node relabelled back to upgrade-required after a
# failure goes on to cordon-required, where restoring in between would only flap.
# "" is libs' UpgradeStateUnknown: the operator decides next between required and done.
NOTHING_STATES = frozenset({"upgrade-required", ""})

ALL_STATES = FREE_STATES | KEEP_STATES | RESTORE_STATES | NOTHING_STATES


def state_label_key(driver_name: str) -> str:
    """``nvidia.com/gpu-driver-upgrade-state`` for the default driver name ``gpu``."""
    return f"nvidia.com/{driver_name}-driver-upgrade-state"


def mode_for(state: str | None) -> Mode:
    """What the controller does with a node whose state label has this value.

    ``None`` is a vanished label: gpu-operator removes it from every node when
    auto-upgrade is turned off, so whatever we parked is restored (an abort). States this
    module does not know (a future state) keep what is parked and free nothing, as the
    requestor-mode states do: the safe side while the upgrade is in an unknown step.
    """
    if state is None:
        return "abort"
    if state in FREE_STATES:
        return "free"
    if state in RESTORE_STATES:
        return "restore"
    if state in NOTHING_STATES:
        return "nothing"
    return "keep"


def is_unknown(state: str | None) -> bool:
    """A value this version does not know (kept, and reported once per node and value)."""
    return state is not None and state not in ALL_STATES
