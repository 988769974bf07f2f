"""The real node: a kubelet with containerd, kube-proxy and the CNI bridge, scheduled by a
real kube-scheduler, next to a control plane of its own (etcd, kube-apiserver and
kube-controller-manager with its default controllers), running the project's image.

Built from Go modules and Debian packages by the scripts beside this file (cached like the
control plane): ``host-packages.sh`` (runc, buildah, debootstrap, iptables from apt),
``build.sh`` (kubelet, kube-scheduler, kube-proxy, kubectl, containerd, the CNI plugins,
helm, pause), ``base.sh`` (the base image, debootstrap) and ``images.sh`` (the project's
image from the checkout's ``Dockerfile``). docs/development.md, "The real node".

Where it lives, so that no packet can leave the machine and nothing stays behind:

- A holder process (``unshare --net --mount``) owns a network namespace and a private
  mount namespace. containerd, the kubelet and kube-proxy run inside both (``nsenter``),
  with ``/run``, ``/var/lib`` and ``/var/log`` on tmpfs there and the kernel tunables the
  kubelet would set read from files bound over them (the host's stay as they are). Their
  mounts, the pod bridge, the pods' veths and kube-proxy's rules all live in those
  namespaces and go with them.
- The only link out of the node's namespace is a veth to the host: :data:`HOST_IP` (the
  API server's address) on the host's end, :data:`NODE_IP` (the node's InternalIP) on the
  node's. The node namespace has no default route; the host routes the pod range
  (:data:`POD_CIDR`) into the veth and has an ``unreachable`` route for the Service range
  (:data:`SERVICE_CIDR`), set before anything starts. :func:`route_problems` checks every
  range in both namespaces and :func:`start` refuses to go on unless all are local.
- Fixed names (the host's link, the cgroup parent :data:`CGROUP_ROOT`, the ranges): one
  node on the machine at a time, behind the flock on :data:`LOCK_FILE`. Every process is
  recorded (pid and program) in :data:`STATE_FILE`, so that a session that died is cleaned
  up by the next one; :meth:`Node.stop` ends every process by pid and removes every route,
  cgroup and file of the node, and :func:`leftovers` says what of it is still on the machine.

Synchronous (stdlib only), like :mod:`testenv`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import testenv
from testenv import ControlPlane, ControlPlaneError, free_port, process_alive

NODE_DIR = Path(__file__).resolve().parent
NAME = "shared-svc-node"
HOST_LINK = "ssvc-node0"  # the host's end of the veth
NODE_LINK = "eth0"  # its end in the node's namespace
HOST_IP = "10.247.0.1"
NODE_IP = "10.247.0.2"
LINK_PREFIX = 30
POD_CIDR = "10.245.0.0/24"
SERVICE_CIDR = "10.246.0.0/24"
BRIDGE = "cni0"
CGROUP_ROOT = "shared-svc-node"
CGROUP_FS = Path("/sys/fs/cgroup")
LOCK_FILE = Path("/run/lock/shared-svc-node.lock")
STATE_FILE = Path("/run/shared-svc-node.json")
PAUSE_IMAGE = "localhost/pause:3.10"
# What the kubelet sets at start when they differ (container_manager_linux.go
# setupKernelTunables): inside the node's mount namespace it reads these values from files
# bound over /proc/sys, so that it writes none of the host's.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# tmpfs in the node's mount namespace: the defaults of containerd, runc, the CNI plugins
# and the kubelet that no flag moves (shim sockets in /run/containerd, /var/lib/cni,
# /var/log/containers) land there.
MASKED = ("/run", "/var/lib", "/var/log")
HOST_COMMANDS = ("unshare", "nsenter", "ip", "iptables-save", "runc", "mount", "openssl")
# Stop order: the clients of containerd first; containers (by cgroup) and shims after it.
NODE_PROCESSES = ("kubelet", "kube-proxy", "containerd")


class NodeError(ControlPlaneError):
    """The node could not be built, started or cleaned up; the message says why."""


@dataclass(frozen=True)
class Builds:
    """The directories of the node's cached builds."""

    programs: Path  # build.sh's: bin/, cni/, pause
    images: Path  # images.sh's: shared-svc.tar, shared-svc-rebuilt.tar, pause.tar, image.json

    def bin(self, name: str) -> Path:
        return self.programs / "bin" / name

    @property
    def cni(self) -> Path:
        return self.programs / "cni"

    def image_info(self) -> dict[str, Any]:
        info: dict[str, Any] = json.loads((self.images / "image.json").read_text())
        return info


def host_packages() -> None:
    """Installs the Debian packages the node needs (host-packages.sh: a dpkg query when
    they are there)."""
    proc = subprocess.run(["bash", str(NODE_DIR / "host-packages.sh")], check=False)
    if proc.returncode != 0:
        raise NodeError(f"host packages missing (exit {proc.returncode}); see the output above")


def build(minor: str | None = None) -> Builds:
    """The host's packages, then the cached builds (each a hash when nothing changed)."""
    from testenv.builds import cached_build

    host_packages()
    version = [minor] if minor else []
    programs = cached_build(
        NODE_DIR / "build.sh",
        *version,
        override_env="SHARED_SVC_NODE_DIR",
        what="the node's programs",
        error=NodeError,
    )
    base = cached_build(
        NODE_DIR / "base.sh",
        override_env="SHARED_SVC_NODE_BASE_DIR",
        what="the node's base image",
        error=NodeError,
    )
    images = cached_build(
        NODE_DIR / "images.sh",
        str(programs),
        str(base),
        override_env="SHARED_SVC_NODE_IMAGES_DIR",
        what="the project's image",
        error=NodeError,
    )
    return Builds(programs, images)


def _run(
    args: list[str], *, check: bool = True, timeout: float = 60, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, check=False, timeout=timeout, input=input
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NodeError(f"{' '.join(args)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def check_host() -> None:
    """What the node needs of the machine, each missing piece said in one line."""
    if os.geteuid() != 0:
        raise NodeError("the real node needs root (network and mount namespaces, cgroups)")
    missing = [c for c in HOST_COMMANDS if shutil.which(c) is None]
    if missing:
        raise NodeError(f"missing commands: {' '.join(missing)} (testenv/node/host-packages.sh)")
    if not cgroup_mounts():
        raise NodeError(f"no cgroup hierarchy mounted under {CGROUP_FS}")


def cgroup_mounts() -> dict[str, Path]:
    """Every cgroup hierarchy under /sys/fs/cgroup: its name (the controllers, or
    ``unified`` for cgroup v2) -> its mount point."""
    out: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0] if right else ""
        point = Path(left.split()[4])
        if fstype in ("cgroup", "cgroup2") and CGROUP_FS in (point, *point.parents):
            out[point.name if point != CGROUP_FS else "unified"] = point
    return out


def _ns_link(pid: int, kind: str, tid: int | None = None) -> str | None:
    """The namespace ``kind`` of process ``pid`` (of its thread ``tid`` if given)."""
    task = "" if tid is None else f"task/{tid}/"
    try:
        return os.readlink(f"/proc/{pid}/{task}ns/{kind}")
    except OSError:
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _cgroup_dirs(root: Path) -> list[Path]:
    """The cgroup directories under ``root``, deepest first. ``os.walk`` passes over a
    directory that goes while it walks (the kubelet removes a pod's cgroups as it stops
    it), where ``Path.rglob`` raises."""
    found = [Path(top) / d for top, dirs, _ in os.walk(root) for d in dirs]
    return sorted(found, key=lambda p: -len(p.parts))


def _cgroup_pids() -> set[int]:
    """Every process in the node's cgroups (the containers), in any hierarchy."""
    out: set[int] = set()
    for mount in cgroup_mounts().values():
        root = mount / CGROUP_ROOT
        if not root.is_dir():
            continue
        for cgroup in [root, *_cgroup_dirs(root)]:
            with contextlib.suppress(OSError):
                out |= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
    return out


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if process_alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if process_alive(p)}
    return left


def _stop_pid(pid: int, name: str, timeout: float = 15.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``: the process ``name`` at ``pid`` only (a
    reused pid running something else is left alone). True when it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not process_alive(pid, name):
            return True
        _kill(pid, sig)
        deadline = time.monotonic() + timeout
        while process_alive(pid, name) and time.monotonic() < deadline:
            time.sleep(0.05)
    return not process_alive(pid, name)


# The node's long-running programs (build.sh's), which nothing but a node runs.
DAEMONS = ("kubelet", "kube-proxy", "kube-scheduler", "containerd", "containerd-shim-runc-v2")
# Processes on the host's side, stopped by name in their own order (not with the node's).
HOST_SIDE = ("kube-scheduler", *testenv.STOP_ORDER)


def _runs_node(args: list[str], programs: Path | None, workdir: str) -> bool:
    """A command line of a node's: one of its daemons from ``programs``, or naming a
    node's ``workdir`` (a prefix matches every node's)."""
    if not args:
        return False
    program = Path(args[0])
    if programs is not None and program.parent == programs / "bin" and program.name in DAEMONS:
        return True
    return any(workdir in a for a in args)


@dataclass
class State:
    """What a node put on the machine, recorded in :data:`STATE_FILE` as it goes."""

    workdir: str
    holder: int | None = None
    netns: str | None = None  # the holder's namespaces ("net:[4026532...]")
    mntns: str | None = None
    pids: dict[str, int] = field(default_factory=dict)  # host-side processes by program
    routes: list[list[str]] = field(default_factory=list)  # `ip route` args added
    bin_dir: str = ""

    def save(self) -> None:
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__))
        tmp.replace(STATE_FILE)

    @classmethod
    def load(cls) -> State | None:
        try:
            return cls(**json.loads(STATE_FILE.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def holder_alive(self) -> bool:
        return (
            self.holder is not None
            and process_alive(self.holder, "sleep")
            and _ns_link(self.holder, "net") == self.netns
        )

    def ours(self, pid: int) -> bool:
        """A process of this node: in its namespaces while the holder keeps them (so the
        namespace ids cannot have been reused), or running one of its daemons or naming
        its workdir (containerd's shims: ``-address <workdir>/containerd/containerd.sock``)."""
        if pid == os.getpid():
            return False
        if self.holder_alive() and (
            _ns_link(pid, "net") == self.netns or _ns_link(pid, "mnt") == self.mntns
        ):
            return True
        return _runs_node(_cmdline(pid), Path(self.bin_dir) if self.bin_dir else None, self.workdir)

    def processes(self) -> set[int]:
        """Every live process of the node (the holder included), containers too."""
        return {p for p in _pids() if self.ours(p)} | _cgroup_pids()


def _cleanup(state: State, stop_control_plane: Callable[[], None] | None = None) -> list[str]:
    """Ends every process of ``state`` by pid and removes what it put on the machine, in
    an order that leaves nothing running against something already gone. Returns what
    could not be removed (empty when the machine is clean)."""
    problems: list[str] = []
    pids = dict(state.pids)
    # 1. The kubelet (it would restart containers) and kube-proxy.
    for name in ("kubelet", "kube-proxy"):
        if name in pids and not _stop_pid(pids[name], name):
            problems.append(f"{name} (pid {pids[name]}) did not stop")
    # 2. The containers, by the node's cgroups.
    for _ in range(3):
        containers = _cgroup_pids()
        if not containers:
            break
        for pid in containers:
            _kill(pid, signal.SIGKILL)
        _wait_gone(containers, 10)
    # 3. containerd, then its shims and whatever else runs in the node's namespaces.
    if "containerd" in pids and not _stop_pid(pids["containerd"], "containerd"):
        problems.append(f"containerd (pid {pids['containerd']}) did not stop")
    host_side = {pid for name, pid in pids.items() if name in HOST_SIDE}
    rest = state.processes() - {state.holder} - host_side
    for pid in rest:
        _kill(pid, signal.SIGKILL)
    left = _wait_gone(rest, 10)
    if left:
        problems.append(f"processes of the node still running: {sorted(left)}")
    # 4. The scheduler and the control plane (before the veth and its address go).
    if "kube-scheduler" in pids and not _stop_pid(pids["kube-scheduler"], "kube-scheduler"):
        problems.append(f"kube-scheduler (pid {pids['kube-scheduler']}) did not stop")
    if stop_control_plane is not None:
        stop_control_plane()
    else:  # a session that died: its control plane's processes by pid
        left_cp = testenv.stop_processes({n: p for n, p in pids.items() if n in testenv.STOP_ORDER})
        problems += [f"{n} (pid {p}) did not stop" for n, p in left_cp.items()]
    # 5. The veth, from the host's side (one end deleted deletes both, at once), then the
    #    holder: its namespaces go, with the bridge and every mount in them. The kernel
    #    frees a namespace in its own time: a whole run saw a veth left in it outlive the
    #    holder by over 60 s with nothing holding it that /proc shows.
    if _link_exists(HOST_LINK):
        out = _run(["ip", "link", "del", HOST_LINK], check=False)
        if out.returncode != 0 and _link_exists(HOST_LINK):
            problems.append(f"link {HOST_LINK}: {out.stderr.strip()}")
    if state.holder is not None and not _stop_pid(state.holder, "sleep", timeout=5):
        problems.append(f"the namespace holder (pid {state.holder}) did not stop")
    # Gone with its deletion above; if not, whatever still keeps the namespace (a process
    # or thread that entered it late, an open descriptor, a bind mount) is ended or
    # unmounted here, and named if the link stays.
    deadline = time.monotonic() + 60
    kept: list[str] = []
    while _link_exists(HOST_LINK) and time.monotonic() < deadline:
        if state.netns is not None:
            kept = _release_namespace(state.netns)
        time.sleep(0.1)
    if _link_exists(HOST_LINK):
        problems.append(
            f"link {HOST_LINK} still there (something keeps the node's namespace:"
            f" {'; '.join(kept) or 'nothing seen, the kernel has not freed it'})"
        )
    # 6. The host's routes, the cgroups, the workdir and the record.
    for route in reversed(state.routes):
        out = _run(["ip", "route", "del", *route], check=False)
        # gone already: the veth's routes go with it
        gone = ("No such process", "Cannot find device")
        if out.returncode != 0 and not any(g in out.stderr for g in gone):
            problems.append(f"route {' '.join(route)}: {out.stderr.strip()}")
    problems += _remove_cgroups()
    workdir = Path(state.workdir)
    mounted = [m for m in _mount_points() if str(workdir) in m]
    if mounted:
        problems.append(f"still mounted: {mounted}")
    elif workdir.exists():
        shutil.rmtree(workdir, ignore_errors=True)
    STATE_FILE.unlink(missing_ok=True)
    return problems


def _release_namespace(netns: str) -> list[str]:
    """What keeps the network namespace ``netns`` ("net:[...]") alive after its holder
    went, each released: a process with a thread in it is killed, a bind mount of it (in
    this mount namespace) unmounted; a descriptor of a process of ours is named only. The
    id cannot have been reused while any of these keeps it."""
    kept = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        if any(_ns_link(pid, "net", tid) == netns for tid in tids):
            kept.append(f"pid {pid} {' '.join(_cmdline(pid))[:80]!r} in it (killed)")
            _kill(pid, signal.SIGKILL)
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == netns:
                        kept.append(f"pid {pid} {' '.join(_cmdline(pid))[:80]!r} holds fd {fd}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[3] == netns:
            kept.append(f"mounted at {fields[4]} (unmounted)")
            _run(["umount", "-l", fields[4]], check=False)
    return kept


def _remove_cgroups() -> list[str]:
    problems = []
    for mount in cgroup_mounts().values():
        root = mount / CGROUP_ROOT
        if not root.is_dir():
            continue
        for d in [*_cgroup_dirs(root), root]:
            for _ in range(50):  # a cgroup whose last task just exited is busy for a moment
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        if root.exists():
            problems.append(f"cgroup {root} still there")
    return problems


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def firewall() -> str:
    """The host's firewall rules (iptables-save of both backends), for comparisons."""
    out = []
    for cmd in ("iptables-legacy-save", "iptables-nft-save", "ip6tables-legacy-save"):
        if shutil.which(cmd):
            text = _run([cmd], check=False).stdout
            out.append("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    return "\n".join(out)


WORKDIR_PREFIX = "shared-svc-node-"


def leftovers(programs: Path | None = None, before_firewall: str | None = None) -> list[str]:
    """What of a node is still on the machine (nothing, once it stopped): its state file,
    a process running a daemon of its ``programs`` (build.sh's directory), naming a node's
    workdir or in its cgroups, a mount under a workdir, its link or bridge, its addresses, a route of
    its ranges, its cgroups; with ``before_firewall`` (the host's rules before the node) a
    new firewall chain of kube-proxy or the CNI plugins, or any change of those rules."""
    found: list[str] = []
    if STATE_FILE.exists():
        found.append(f"state file {STATE_FILE}")
    for pid in _pids():
        args = _cmdline(pid)
        if pid != os.getpid() and _runs_node(args, programs, WORKDIR_PREFIX):
            found.append(f"process {pid}: {' '.join(args)[:160]}")
    found += [f"process {p} in cgroup {CGROUP_ROOT}" for p in _cgroup_pids()]
    found += [f"mount {m}" for m in _mount_points() if WORKDIR_PREFIX in m]
    for link in (HOST_LINK, BRIDGE):
        if _link_exists(link):
            found.append(f"link {link}")
    addresses = _run(["ip", "-o", "addr"], check=False).stdout
    found += [f"address {ip}" for ip in (HOST_IP, NODE_IP) if f" {ip}/" in addresses]
    nets = [
        ipaddress.ip_network(c, strict=False)
        for c in (POD_CIDR, SERVICE_CIDR, f"{HOST_IP}/{LINK_PREFIX}")
    ]
    kinds = ("unreachable", "prohibit", "blackhole", "throw", "local", "broadcast", "multicast")
    for line in _run(
        ["ip", "-4", "route", "show", "table", "all"], check=False
    ).stdout.splitlines():
        words = line.split()
        dst = words[1] if len(words) > 1 and words[0] in kinds else (words or [""])[0]
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(dst, strict=False)
            if any(net.overlaps(n) for n in nets):
                found.append(f"route {line}")
    for mount in cgroup_mounts().values():
        if (mount / CGROUP_ROOT).exists():
            found.append(f"cgroup {mount / CGROUP_ROOT}")
    if before_firewall is not None:  # the host's rules are others' too: only a change counts
        rules = firewall()

        def chains(text: str) -> set[str]:
            return {w for w in text.split() if w.startswith(("KUBE-", "CNI-"))}

        added = sorted(chains(rules) - chains(before_firewall))
        if added:
            found.append(f"firewall chains {added}")
        if rules != before_firewall:
            found.append("the host's firewall rules differ from before the node")
    return found


def _ip_route_get(address: str, ns: list[str]) -> str:
    """Where ``address`` routes: ``dev <link>``, ``local``, or ``unreachable (<why>)``."""
    proc = _run([*ns, "ip", "-j", "route", "get", address], check=False)
    if proc.returncode != 0:
        return f"unreachable ({proc.stderr.strip()})"
    (route,) = json.loads(proc.stdout)
    if route.get("type") == "local" or route.get("dev") == "lo":
        return "local"
    kind = route.get("type", "unicast")
    return f"dev {route['dev']}" if kind == "unicast" else f"{kind}"


def route_problems(holder: int | None) -> list[str]:
    """Where the node's addresses would route, in the host's network namespace and, with
    ``holder``, in the node's; any answer but the expected local one is a problem. The
    host: the pod range and the node's address into the veth, the Service range
    unreachable, :data:`HOST_IP` its own. The node: the pods on its bridge (unreachable
    before the bridge exists), the Service range unreachable (kube-proxy translates it
    before routing), the host's end of the veth, and nothing else: an address outside
    (and the host's default gateway) is unreachable, never the veth (a host that forwards
    would send it on)."""
    pod, svc = ipaddress.ip_network(POD_CIDR), ipaddress.ip_network(SERVICE_CIDR)
    unreachable = "unreachable"
    pods, services = (str(pod[2]), str(pod[-2])), (str(svc[1]), str(svc[-2]))
    expected: dict[str, dict[str, set[str]]] = {
        "host": {
            **{a: {f"dev {HOST_LINK}"} for a in pods},
            **{a: {unreachable} for a in services},
            NODE_IP: {f"dev {HOST_LINK}"},
            HOST_IP: {"local"},
        },
        "node": {
            **{a: {f"dev {BRIDGE}", unreachable} for a in pods},
            **{a: {unreachable} for a in services},
            NODE_IP: {"local"},
            HOST_IP: {f"dev {NODE_LINK}"},
            "1.1.1.1": {unreachable},
            default_gateway() or "192.0.2.1": {unreachable},
        },
    }
    namespaces = (
        {"host": []}
        if holder is None
        else {
            "host": [],
            "node": ["nsenter", f"--target={holder}", "--net", "--"],
        }
    )
    problems = []
    for side, ns in namespaces.items():
        for address, allowed in expected[side].items():
            answer = _ip_route_get(address, ns)
            if answer.split(" (")[0] not in allowed:
                problems.append(
                    f"{address} routes to {answer} in the {side} namespace"
                    f" (expected {' or '.join(sorted(allowed))})"
                )
    return problems


def default_gateway() -> str | None:
    """The host's default gateway (an address off the machine), if it has one."""
    out = _run(["ip", "-j", "route", "show", "default"], check=False).stdout
    with contextlib.suppress(ValueError, IndexError, KeyError):
        gateway: str = json.loads(out)[0]["gateway"]
        return gateway
    return None


class _Lock:
    """The machine-wide node lock (flock on :data:`LOCK_FILE`), held while a node runs."""

    def __init__(self, timeout: float) -> None:
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise NodeError(
                        f"another real node runs on this machine ({LOCK_FILE} held for {timeout:.0f}s)"
                    ) from None
                if not said:
                    print(
                        f"node: another real node runs on this machine; waiting for {LOCK_FILE}...",
                        flush=True,
                    )
                    said = True
                time.sleep(1)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


@dataclass
class Node:
    """A running node and its control plane. Use :func:`start`; :meth:`stop` (or the
    context manager) cleans up."""

    workdir: Path
    builds: Builds
    state: State
    control_plane: ControlPlane
    firewall_before: str
    _lock: _Lock
    keep_logs: Path | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopped: bool = False
    stop_problems: list[str] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig of the node's control plane."""
        return self.control_plane.kubeconfig

    def in_node(self, *args: str) -> list[str]:
        """``args`` run in the node's network and mount namespaces."""
        assert self.state.holder is not None
        return ["nsenter", f"--target={self.state.holder}", "--net", "--mount", "--", *args]

    def tool_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "HELM_"))}
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            HELM_CACHE_HOME=str(self.workdir / "helm" / "cache"),
            HELM_CONFIG_HOME=str(self.workdir / "helm" / "config"),
            HELM_DATA_HOME=str(self.workdir / "helm" / "data"),
        )
        return env

    def tool(self, name: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """One of build.sh's programs against the node's control plane, as the admin (its
        kubeconfig; helm's directories in the node's); not checked."""
        return subprocess.run(
            [str(self.builds.bin(name)), *args],
            capture_output=True,
            text=True,
            env=self.tool_env(),
            timeout=timeout,
            check=False,
        )

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self.tool("helm", *args, timeout=timeout)

    def kubectl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.tool("kubectl", *args, timeout=timeout)

    def container_pids(self) -> set[int]:
        """The processes of every container on the node (its cgroups)."""
        return _cgroup_pids()

    def log(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> list[str]:
        """Stops everything by pid and removes what the node put on the machine; returns
        what could not be (also kept in :attr:`stop_problems`). Idempotent."""
        if self.stopped:
            return self.stop_problems
        self.stopped = True
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in [*self.workdir.glob("*.log"), *self.workdir.glob("control-plane/*.log")]:
                with contextlib.suppress(OSError):
                    shutil.copy2(log, self.keep_logs / log.name)
        try:
            self.stop_problems = _cleanup(self.state, self.control_plane.stop)
        finally:
            for proc in self.processes.values():
                with contextlib.suppress(Exception):
                    proc.wait(timeout=1)
            self._lock.release()
        return self.stop_problems

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _wait(check: Callable[[], Any], timeout: float, what: str, why: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise NodeError(f"{what} not within {timeout:.0f}s\n{why()}")
        time.sleep(0.5)


def start(
    parent: Path | None = None,
    builds: Builds | None = None,
    *,
    keep_logs: Path | None = None,
    lock_timeout: float = 3600,
) -> Node:
    """Builds (cached), then starts the node: namespaces and routes first (checked local),
    the control plane on :data:`HOST_IP`, kube-scheduler, containerd with the images,
    the kubelet (until the Node is Ready) and kube-proxy (until it serves the
    ``kubernetes`` Service). Its files go to a new directory in ``parent`` (the system's
    temporary directory by default), removed by :meth:`Node.stop` (which first copies the
    logs to ``keep_logs``, when given). Raises NodeError with the reason (and a log tail); whatever
    started is stopped and removed before it raises."""
    check_host()
    builds = builds or build()
    lock = _Lock(lock_timeout)
    try:
        stale = State.load()
        if stale is not None:  # a session that died with its node running
            print(
                f"node: cleaning up a node left by an earlier session ({stale.workdir})", flush=True
            )
            problems = _cleanup(stale)
            if problems:
                raise NodeError(f"could not clean up the earlier node: {'; '.join(problems)}")
        left = leftovers(builds.programs)
        if left:
            raise NodeError(f"the machine is not clean for a node: {'; '.join(left)}")
    except BaseException:
        lock.release()
        raise
    before = firewall()
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX, dir=parent))
    state = State(workdir=str(workdir), bin_dir=str(builds.programs))
    state.save()
    node: Node | None = None
    try:
        _namespaces(state, workdir)
        problems = route_problems(state.holder)
        if problems:
            raise NodeError(
                "a range of the node would route off the machine: " + "; ".join(problems)
            )
        cp = _control_plane(workdir)
        state.pids.update({n: p.pid for n, p in cp.processes.items()})
        state.save()
        node = Node(workdir, builds, state, cp, before, lock, keep_logs)
        _start_components(node)
    except BaseException:
        if node is not None:
            node.stop()
        else:
            _cleanup(state)
            lock.release()
        raise
    return node


def _namespaces(state: State, workdir: Path) -> None:
    """The holder, its network (a veth to the host, no default route) and mount
    namespaces (tmpfs over :data:`MASKED`, the kubelet's tunables), the host's routes."""
    holder = subprocess.Popen(
        ["unshare", "--net", "--mount", "--propagation", "private", "sleep", "infinity"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    state.holder = holder.pid
    state.save()
    own_net = _ns_link(os.getpid(), "net")
    _wait(
        lambda: (
            (link := _ns_link(holder.pid, "net"))
            and link != own_net
            and process_alive(holder.pid, "sleep")
        ),
        10,
        "the node's namespaces",
        lambda: f"holder exited with {holder.poll()}",
    )
    state.netns = _ns_link(holder.pid, "net")
    state.mntns = _ns_link(holder.pid, "mnt")
    state.save()
    net = ["nsenter", f"--target={holder.pid}", "--net", "--"]
    mnt = ["nsenter", f"--target={holder.pid}", "--mount", "--"]
    # The mount namespace: tmpfs over the defaults no flag moves; the kubelet's tunables.
    for path in MASKED:
        _run([*mnt, "mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", path])
    for key, value in KUBELET_SYSCTLS.items():
        target = Path("/proc/sys") / key
        if target.read_text().strip() != value:
            fake = _write(workdir / "sysctl" / key.replace("/", "."), value + "\n")
            _run([*mnt, "mount", "--bind", str(fake), str(target)])
    # The network namespace: the veth, the node's address, forwarding for the pods.
    _run(
        [
            "ip",
            "link",
            "add",
            HOST_LINK,
            "type",
            "veth",
            "peer",
            "name",
            NODE_LINK,
            "netns",
            str(holder.pid),
        ]
    )
    _run(["ip", "addr", "add", f"{HOST_IP}/{LINK_PREFIX}", "dev", HOST_LINK])
    _run(["ip", "link", "set", HOST_LINK, "up"])
    _run([*net, "ip", "link", "set", "lo", "up"])
    _run([*net, "ip", "addr", "add", f"{NODE_IP}/{LINK_PREFIX}", "dev", NODE_LINK])
    _run([*net, "ip", "link", "set", NODE_LINK, "up"])
    _run([*net, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    # Bridged pod-to-pod traffic through kube-proxy's rules (as kubeadm requires).
    _run([*net, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"], check=False)
    _run([*net, "ip", "route", "add", "unreachable", SERVICE_CIDR])
    # The host: the pods through the veth (the API server calls webhooks at pod IPs), the
    # Services nowhere (only kube-proxy in the node translates them).
    for route in (["unreachable", SERVICE_CIDR], [POD_CIDR, "via", NODE_IP, "dev", HOST_LINK]):
        _run(["ip", "route", "add", *route])
        state.routes.append(route)
        state.save()


def _control_plane(workdir: Path) -> ControlPlane:
    """etcd, kube-apiserver on :data:`HOST_IP` (the Service range :data:`SERVICE_CIDR`,
    webhooks called at their pods' IPs, the ServiceAccount admission plugin on: pods get
    their tokens) and kube-controller-manager with its default controllers."""
    return testenv.start(
        workdir / "control-plane",
        address=HOST_IP,
        controller_manager=True,
        apiserver_flags={
            "--service-cluster-ip-range": SERVICE_CIDR,
            "--disable-admission-plugins": None,
            "--enable-aggregator-routing": "true",
            "--kubelet-preferred-address-types": "InternalIP,Hostname",
            # pods reach the API server through the kubernetes Service: its endpoint is the
            # node address (not loopback), kept by the default reconciler
            "--endpoint-reconciler-type": None,
        },
        controller_manager_flags={
            "--controllers": "*",
            # the node-lifecycle controller patches the Node under its own identity
            "--use-service-account-credentials": "true",
        },
    )


def _spawn_node_process(node: Node, name: str, args: list[str], *, in_node: bool) -> None:
    command = node.in_node("nice", "-n", "10", *args) if in_node else ["nice", "-n", "10", *args]
    proc = testenv._spawn(command, node.workdir / f"{name}.log")
    node.processes[name] = proc
    node.state.pids[name] = proc.pid
    node.state.save()


def _alive(node: Node, name: str) -> None:
    proc = node.processes[name]
    if proc.poll() is not None:
        raise NodeError(
            f"{name} exited with {proc.returncode}; log {node.workdir / (name + '.log')}:\n{node.log(name)}"
        )


def _identity(node: Node, account: str, role: str) -> Path:
    """A kubeconfig holding a ServiceAccount token bound to the ClusterRole ``role``."""
    cp = node.control_plane
    cp.apply_manifests(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{NAME}:{account}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": account, "namespace": "kube-system"}
                ],
            }
        ]
    )
    token = cp.service_account_token("kube-system", account, seconds=7 * 24 * 3600)
    return cp.write_kubeconfig(node.workdir / f"{account}.kubeconfig", token, user=account)


def _start_components(node: Node) -> None:
    cp, w, b = node.control_plane, node.workdir, node.builds
    _, version = cp.request("GET", "/version")
    kubelet_version = _run([str(b.bin("kubelet")), "--version"]).stdout.split()[-1]
    if kubelet_version != version["gitVersion"]:
        raise NodeError(
            f"kubelet {kubelet_version} is not the control plane's {version['gitVersion']}"
        )
    # kube-scheduler, on the host, as the admin (as kube-controller-manager runs).
    port = free_port()
    _spawn_node_process(
        node,
        "kube-scheduler",
        [
            str(b.bin("kube-scheduler")),
            f"--kubeconfig={cp.kubeconfig}",
            f"--authentication-kubeconfig={cp.kubeconfig}",
            f"--authorization-kubeconfig={cp.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--v=1",
        ],
        in_node=False,
    )
    # containerd, in the node.
    ctrd = w / "containerd"
    sock = ctrd / "containerd.sock"
    config = _write(w / "containerd.toml", _containerd_config(node))
    _write(w / "cni" / "net.d" / "10-bridge.conflist", json.dumps(_cni_config(w), indent=2))
    _spawn_node_process(
        node, "containerd", [str(b.bin("containerd")), f"--config={config}"], in_node=True
    )
    ctr = node.in_node(str(b.bin("ctr")), f"--address={sock}", "--namespace=k8s.io")

    def serving() -> bool:
        _alive(node, "containerd")
        return _run([*ctr, "version"], check=False).returncode == 0

    _wait(serving, 60, "containerd serving", lambda: node.log("containerd"))
    for archive in ("pause.tar", "shared-svc.tar", "shared-svc-rebuilt.tar"):
        _run(
            [*ctr, "images", "import", "--snapshotter=overlayfs", str(b.images / archive)],
            timeout=300,
        )
    # The kubelet, in the node, as a ServiceAccount bound to system:node.
    kubelet_kubeconfig = _identity(node, "shared-svc-node-kubelet", "system:node")
    resolv = _write(w / "resolv.conf", "nameserver 127.0.0.1\noptions ndots:1\n")
    kubelet_config = _write(w / "kubelet.yaml", yaml.safe_dump(_kubelet_config(node, sock, resolv)))
    for mount in cgroup_mounts().values():
        if mount.name == "unified":
            continue
        root = mount / CGROUP_ROOT
        root.mkdir(exist_ok=True)
        for key in ("cpuset.cpus", "cpuset.mems"):
            if (mount / key).exists():
                (root / key).write_text((mount / key).read_text())
    _spawn_node_process(
        node,
        "kubelet",
        [
            str(b.bin("kubelet")),
            f"--config={kubelet_config}",
            f"--kubeconfig={kubelet_kubeconfig}",
            f"--root-dir={w / 'kubelet'}",
            f"--hostname-override={NAME}",
            f"--node-ip={NODE_IP}",
            "--v=1",
        ],
        in_node=True,
    )

    def ready() -> bool:
        _alive(node, "kubelet")
        status, obj = cp.request("GET", f"/api/v1/nodes/{NAME}")
        if status != 200:
            return False
        conditions = {c["type"]: c["status"] for c in obj["status"].get("conditions", [])}
        taints = obj["spec"].get("taints") or []
        return conditions.get("Ready") == "True" and not taints

    _wait(ready, 240, f"Node {NAME} Ready and untainted", lambda: node.log("kubelet"))
    # kube-proxy, in the node, as a ServiceAccount bound to system:node-proxier.
    proxy_kubeconfig = _identity(node, "shared-svc-node-proxy", "system:node-proxier")
    proxy_config = _write(w / "kube-proxy.yaml", yaml.safe_dump(_proxy_config(proxy_kubeconfig)))
    _spawn_node_process(
        node,
        "kube-proxy",
        [str(b.bin("kube-proxy")), f"--config={proxy_config}", "--v=1"],
        in_node=True,
    )

    def proxied() -> bool:
        _alive(node, "kube-proxy")
        rules = _run(node.in_node("iptables-save", "-t", "nat"), check=False).stdout
        return "default/kubernetes:https" in rules

    _wait(
        proxied,
        120,
        "kube-proxy's rules for the kubernetes Service",
        lambda: node.log("kube-proxy"),
    )

    def accounts() -> bool:  # what every pod of the default namespace mounts
        return (
            cp.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            and cp.request("GET", "/api/v1/namespaces/default/configmaps/kube-root-ca.crt")[0]
            == 200
        )

    _wait(
        accounts,
        60,
        "the default ServiceAccount and kube-root-ca.crt",
        lambda: cp._tail("kube-controller-manager"),
    )


def _containerd_config(node: Node) -> str:
    w, b = node.workdir, node.builds
    ctrd = w / "containerd"
    cri = "plugins.'io.containerd.cri.v1.runtime'"
    return f"""version = 3
root = '{ctrd / "root"}'
state = '{ctrd / "state"}'
disabled_plugins = [
  'io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.aufs',
  'io.containerd.snapshotter.v1.blockfile', 'io.containerd.snapshotter.v1.erofs',
  'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing',
]

[grpc]
  address = '{ctrd / "containerd.sock"}'

[ttrpc]
  address = '{ctrd / "containerd.sock.ttrpc"}'

[plugins.'io.containerd.internal.v1.opt']
  path = '{ctrd / "opt"}'

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{PAUSE_IMAGE}'

[{cri}]
  enable_selinux = false
  # No CAP_SYS_RESOURCE here: the pause container's -998 would fail (real-node.md 3).
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = []
  [{cri}.containerd]
    default_runtime_name = 'runc'
    [{cri}.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = '/usr/bin/runc'
        Root = '{w / "runc"}'
        SystemdCgroup = false
  [{cri}.cni]
    bin_dirs = ['{b.cni}']
    conf_dir = '{w / "cni" / "net.d"}'
    max_conf_num = 1
"""


def _cni_config(w: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,  # pods keep their addresses: the host routes them back
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(w / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def _kubelet_config(node: Node, sock: Path, resolv: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This host kind: cgroup v1 (hybrid), no systemd (real-node.md 1).
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "containerRuntimeEndpoint": f"unix://{sock}",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        # Reachable only from this machine (the veth): the API server's logs and exec.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "oomScoreAdj": 0,  # no CAP_SYS_RESOURCE (real-node.md 3)
        "makeIPTablesUtilChains": False,
        # No registry to pull an image back from: never collect one.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "failSwapOn": False,
        "resolvConf": str(resolv),
        "clusterDomain": "cluster.local",
        "podLogsDir": str(node.workdir / "pod-logs"),
        "serializeImagePulls": False,
        "podCIDR": POD_CIDR,
        "shutdownGracePeriod": "0s",
    }


def _proxy_config(kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "hostnameOverride": NAME,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Leave the kernel's conntrack settings alone (some are the host's, not the namespace's).
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[Node]:
    node = start(**kwargs)
    try:
        yield node
    finally:
        node.stop()
