"""Benchmark (not a test): the ``shared-svc plan`` command on realistic pods.

Writes pod lists as the API server serves them (``kubectl get --raw
/api/v1/namespaces/gpu-operator/pods``: compact JSON, managedFields included, 15-22 KiB
per pod; tests/realistic.py) with both CRs and four DaemonSets, one straggler pod per
DaemonSet, then runs ``shared-svc plan -f FILE -o json`` as a separate process and
reports its wall time (best of ``--repeat`` runs) and peak RSS (``ru_maxrss`` of the
child, from ``os.wait4``; the largest). Also ``shared-svc --help``, ``plan`` of one small file (the
start-up cost), and the same 1,000 pods as YAML.

Then the fleet (issue 22): 50,000 pods as JSON (compact, as the API server serves them)
and 10,000 pods as ``kubectl get -o yaml`` writes them (231 MB), each ``shared-svc plan``
as its own process: wall time, CPU and VmHWM (its peak RSS). Their inputs take minutes to
write, so they are kept in ~/.cache/shared-svc/bench-plan (keyed by tests/realistic.py);
``--no-fleet`` leaves them out.

    .venv/bin/python benchmarks/bench_plan.py [--sizes 1000,10000] [--repeat 3] [--no-fleet]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from tests.realistic import api_daemonset, api_pod, pod_list
from tests.worlds import APPS, cluster_policy, gc_spec, gpu_cluster

EXE = str(Path(sys.executable).with_name("shared-svc"))


FLEET = {"json": 50_000, "yaml": 10_000}  # pods
CACHE = Path.home() / ".cache" / "shared-svc" / "bench-plan"


def measure(args: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MiB) of ``shared-svc ARGS``; fails on a
    non-zero exit."""
    start = time.perf_counter()
    proc = subprocess.Popen([EXE, *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"shared-svc {' '.join(args)}: exit {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def run(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of ``shared-svc ARGS``; fails on a non-zero exit."""
    wall, _, rss = measure(args)
    return wall, rss


def fleet_items(pods: int) -> Any:
    """The items of ``pod_list(pods)``, one at a time (50,000 pods do not fit in memory
    at once as Python objects)."""
    yield cluster_policy()
    yield gpu_cluster(spec=gc_spec(monitor={"enabled": True}))
    per_app = max(1, pods // len(APPS))
    for app in APPS.values():
        yield api_daemonset(app, per_app)
        for i in range(per_app):
            yield api_pod(app, f"{app}-{i:05d}", f"node-{i:05d}", common=i != per_app - 1)


def write_fleet(path: Path, fmt: str, pods: int) -> None:
    """``pod_list(pods)`` as the API server serves it (JSON) or kubectl writes it (YAML),
    written item by item: the same text as dumping the list whole."""
    part = path.with_suffix(".part")
    with part.open("w") as out:
        if fmt == "json":
            out.write('{"apiVersion":"v1","items":[')
            for index, item in enumerate(fleet_items(pods)):
                out.write(("," if index else "") + json.dumps(item, separators=(",", ":")))
            out.write('],"kind":"List","metadata":{"resourceVersion":""}}')
        else:
            out.write("apiVersion: v1\nitems:\n")
            for item in fleet_items(pods):
                out.write(yaml.dump([item], Dumper=yaml.CSafeDumper))
            out.write("kind: List\nmetadata:\n  resourceVersion: ''\n")
    part.rename(path)


def fleet_inputs() -> dict[str, Path]:
    key = hashlib.sha256(
        Path(__file__).resolve().parents[1].joinpath("tests", "realistic.py").read_bytes()
    )
    paths = {fmt: CACHE / f"pods-{n}-{key.hexdigest()[:12]}.{fmt}" for fmt, n in FLEET.items()}
    for fmt, path in paths.items():
        if not path.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            print(f"writing {path} (once: minutes)", flush=True)
            subprocess.run([sys.executable, __file__, "--write-fleet", f"{fmt}:{path}"], check=True)
    return paths


def best(args: list[str], repeat: int) -> tuple[float, float]:
    runs = [run(args) for _ in range(repeat)]
    return min(w for w, _ in runs), max(r for _, r in runs)


def write_inputs(tmp: str, sizes: list[int]) -> None:
    """The input files (run in a child process: the measuring parent stays small, since a
    child's ru_maxrss starts from the parent's RSS at fork)."""
    for size in sizes:
        listing = pod_list(size)
        Path(tmp, f"pods-{size}.json").write_text(json.dumps(listing, separators=(",", ":")))
        if size == sizes[0]:
            Path(tmp, f"pods-{size}.yaml").write_text(yaml.dump(listing, Dumper=yaml.CSafeDumper))
            Path(tmp, "small.json").write_text(json.dumps(pod_list(4)))
        del listing


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-fleet", action="store_true", help="leave the fleet out")
    parser.add_argument("--write-inputs", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--write-fleet", metavar="FMT:PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.write_inputs:
        write_inputs(args.write_inputs, sizes)
        return
    if args.write_fleet:
        fmt, _, path = args.write_fleet.partition(":")
        write_fleet(Path(path), fmt, FLEET[fmt])
        return
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        subprocess.run(
            [sys.executable, __file__, "--sizes", args.sizes, "--write-inputs", tmp], check=True
        )
        files = {size: Path(tmp) / f"pods-{size}.json" for size in sizes}
        yaml_path = Path(tmp) / f"pods-{sizes[0]}.yaml"
        small = Path(tmp) / "small.json"
        wall, rss = best(["--help"], args.repeat)
        print(f"shared-svc --help: {wall * 1e3:.0f} ms, peak RSS {rss:.0f} MiB")
        base, rss = best(["plan", "-f", str(small), "-o", "json"], args.repeat)
        print(f"plan, 4 pods (start-up): {base * 1e3:.0f} ms, peak RSS {rss:.0f} MiB")
        print(f"{'pods':>8} {'MiB in':>8} {'wall s':>8} {'peak RSS MiB':>13} {'ms/1k pods':>11}")
        per_pod = {}
        for size in sizes:
            wall, rss = best(["plan", "-f", str(files[size]), "-o", "json"], args.repeat)
            per_pod[size] = (wall - base) / size
            mib = files[size].stat().st_size / 2**20
            print(f"{size:>8} {mib:>8.0f} {wall:>8.2f} {rss:>13.0f} {per_pod[size] * 1e6:>11.0f}")
        if len(sizes) > 1:
            lo, hi = sizes[0], sizes[-1]
            print(
                f"cost per pod (start-up taken off) at {hi:,} vs {lo:,} pods: "
                f"{per_pod[hi] / per_pod[lo]:.2f}x (1 or less: linear)"
            )
        wall, rss = best(["plan", "-f", str(yaml_path), "-o", "json"], 1)
        print(f"YAML, {sizes[0]:,} pods: {wall:.2f} s, peak RSS {rss:.0f} MiB")
    if args.no_fleet:
        return
    for fmt, path in fleet_inputs().items():
        mib = path.stat().st_size / 2**20
        wall, cpu, rss = measure(["plan", "-f", str(path), "-o", "json"])
        print(
            f"fleet, {FLEET[fmt]:,} pods of {fmt.upper()} ({mib:.0f} MiB): {wall:.2f} s wall, "
            f"{cpu:.2f} s CPU, VmHWM {rss:.0f} MiB (goal: 10 s, 400 MiB)"
        )


if __name__ == "__main__":
    main()
