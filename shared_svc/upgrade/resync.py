"""Which nodes the upgrade resync looks at again (issue 33): the nodes a pass can still
change, not every node that carries the state label.

gpu-operator with auto-upgrade on labels every GPU node once its driver pod is in sync
(``upgrade-done``), so in a fleet at rest all of them are in the upgrading-node cache. A
pass on such a node reads no pod (``pods.pods_read``), plans no write and shows the
same idle status every time, until the node itself changes, which is an event of its own.
The resync (``upgrade_resync_seconds``) exists for what no event brings: time passing
on a node being freed (eviction timeouts, a blocked eviction's retry), a DaemonSet change
(it keys no node), a pass whose event was lost. None of it can change a node at rest.

What it keeps, tested (proptests/test_upgrade_props.py, tests/test_upgrade_node_events.py):

- a node left out is one whose next pass would plan nothing and show what it shows now;
- a missed event is caught within one period: the rule reads the cached node, so a node
  whose cached copy is no longer at rest (a new state, a record, the parked label) is
  looked at, whether or not its event was handled;
- a record is never orphaned: a node with our record or the parked label is never at
  rest, and a status whose node left the caches gets the pass that drops it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shared_svc.k8s import objects
from shared_svc.k8s.objects import K8sObject
from shared_svc.upgrade import daemonsets, record, states
from shared_svc.upgrade.node_plan import NodeStatus
from shared_svc.upgrade.node_status import listed


def at_rest(node: K8sObject, driver_name: str) -> bool:
    """Nothing of ours on the node and nothing to free or keep: no record annotation (a
    readable one or not), no parked label, and a state that frees and keeps nothing
    (``upgrade-done``, ``upgrade-required``, libs' unknown ``""``, or no label at all)."""
    if objects.annotation(node, record.record_annotation_key(driver_name)) is not None:
        return False
    if objects.label(node, daemonsets.parked_label_key(driver_name)) is not None:
        return False
    state = objects.label(node, states.state_label_key(driver_name))
    return states.mode_for(state) in ("restore", "nothing", "abort")


def settled(status: NodeStatus) -> bool:
    """What a pass shows of a node at rest: idle, and nothing ``upgrade status`` lists."""
    return status.phase == "idle" and not listed(status)


def resync_keys(
    nodes: Iterable[K8sObject], statuses: Mapping[str, NodeStatus], driver_name: str
) -> set[str]:
    """The nodes to look at again: every cached node (``nodes``; a node may come twice)
    but those at rest whose shown status is settled, and every node shown that is no
    longer cached (its pass drops it). A node at rest with no status yet, or with a
    status of before (the last pass of a restore, whose echo brings no pass), is looked
    at once more; after that pass it is settled and left out."""
    keys: set[str] = set()
    cached: set[str] = set()
    for node in nodes:
        name = objects.name_of(node)
        cached.add(name)
        shown = statuses.get(name)
        if shown is None or not settled(shown) or not at_rest(node, driver_name):
            keys.add(name)
    keys.update(name for name in statuses if name not in cached)
    return keys
