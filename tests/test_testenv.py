"""The test control plane's own tooling: ``python -m testenv stop`` and ``testenv/build.sh``.

``stop`` ends kube-apiserver before etcd, kills what ignores SIGTERM and says "stopped" only
when both are gone (tried with stand-ins that behave badly, then with the real control
plane). ``build.sh`` runs one build of the same inputs at a time (tried with a stand-in
``go`` on PATH that records its builds, in a cache directory of the test's own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import testenv
from testenv import cli, process_alive
from testenv import gpu_operator as gpu_env
from testenv import prometheus as prom_env

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "testenv" / "build.sh"
GPU_OPERATOR_BUILD = REPO / "testenv" / "gpu-operator" / "build.sh"
HELMRENDER_BUILD = REPO / "testenv" / "helmrender" / "build.sh"


def spawn_detached(script: str, argv0: str) -> int:
    """Starts ``bash -c script`` as ``argv0`` in a session of its own, as ``testenv start``
    leaves its processes: parent gone (reaped by init), group leader. Returns its pid."""
    launcher = textwrap.dedent(
        """
        import subprocess, sys
        proc = subprocess.Popen(
            ["bash", "-c", 'exec -a "$0" bash -c "$1"', sys.argv[1], sys.argv[2]],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        print(proc.pid)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher, argv0, script],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pid = int(out)
    for _ in range(200):  # until it runs as argv0 (exec done)
        if process_alive(pid, argv0):
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{argv0} (pid {pid}) did not start")


def write_state(directory: Path, pids: dict[str, int]) -> None:
    directory.mkdir(parents=True)
    (directory / "state.json").write_text(
        json.dumps({"url": "https://127.0.0.1:1", "kubeconfig": "k", "workdir": "w", "pids": pids})
    )


def wait_for(path: Path) -> None:
    for _ in range(200):
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_stop_ends_the_apiserver_first_and_kills_it_if_it_ignores_sigterm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "etcd-saw"
    # A kube-apiserver that ignores SIGTERM (as one stuck retrying its storage can seem to).
    api = spawn_detached(
        f"trap '' TERM; touch {tmp_path}/api-up; while :; do sleep 0.1; done", "kube-apiserver"
    )
    # An etcd that notes, when told to stop, whether the API server still ran.
    etcd = spawn_detached(
        f"""trap 's=$(cut -d" " -f3 /proc/{api}/stat 2>/dev/null); \
[ -n "$s" ] && [ "$s" != Z ] && echo alive > {record} || echo gone > {record}; exit 0' TERM
touch {tmp_path}/etcd-up; while :; do sleep 0.1; done""",
        "etcd",
    )
    wait_for(tmp_path / "api-up")
    wait_for(tmp_path / "etcd-up")
    state_dir = tmp_path / "state"
    write_state(state_dir, {"etcd": etcd, "kube-apiserver": api})
    assert process_alive(api, "kube-apiserver") and process_alive(etcd, "etcd")
    try:
        code = cli.main(["stop", "--dir", str(state_dir), "--timeout", "1"])
        assert (code, capsys.readouterr().out) == (0, "stopped\n")
        assert not process_alive(api) and not process_alive(etcd)
        assert record.read_text() == "gone\n", "etcd was stopped while kube-apiserver ran"
        assert not state_dir.exists()
    finally:
        for pid in (api, etcd):
            if process_alive(pid):
                os.killpg(pid, 9)


def test_stop_never_signals_a_process_that_reused_a_pid(tmp_path: Path) -> None:
    """The state file outlived its processes; their pids now belong to something else."""
    other = spawn_detached("while :; do sleep 0.1; done", "not-etcd")
    try:
        state_dir = tmp_path / "state"
        write_state(state_dir, {"etcd": other, "kube-apiserver": other})
        assert cli.main(["stop", "--dir", str(state_dir), "--timeout", "1"]) == 0
        assert process_alive(other, "not-etcd")
    finally:
        os.killpg(other, 9)


def test_stop_keeps_the_directory_and_fails_while_a_process_survives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    api = spawn_detached("while :; do sleep 0.1; done", "kube-apiserver")
    state_dir = tmp_path / "state"
    write_state(state_dir, {"kube-apiserver": api})
    # Signals that change nothing: the process survives even SIGKILL (as one in D state would).
    monkeypatch.setattr(os, "killpg", lambda pid, sig: None)
    try:
        code = cli.main(["stop", "--dir", str(state_dir), "--timeout", "0.2"])
        err = capsys.readouterr().err
        assert code == 2
        assert f"kube-apiserver (pid {api}) still running after SIGKILL" in err
        assert "Traceback" not in err and (state_dir / "state.json").exists()
    finally:
        monkeypatch.undo()
        os.killpg(api, 9)


@pytest.mark.helm
def test_a_marked_test_may_build() -> None:
    assert testenv.build_helmrender().name == "helmrender"
    assert testenv.build_helmrender().exists()


def test_a_test_without_a_build_marker_cannot_start_a_go_build() -> None:
    """tests/conftest.py: a test that reaches a build script carries a marker (apiserver,
    controller_manager, gpu_operator, helm or prometheus), so deselecting them never builds."""
    message = "runs testenv/build.sh \\(a Go build\\) without a marker: mark it apiserver or"
    with pytest.raises(pytest.fail.Exception, match=message):
        testenv.build_binaries()
    with pytest.raises(pytest.fail.Exception, match=r"runs testenv/helmrender/build\.sh"):
        testenv.build_helmrender()
    with pytest.raises(pytest.fail.Exception, match=r"mark it gpu_operator$"):
        gpu_env.build()
    with pytest.raises(pytest.fail.Exception, match=r"mark it prometheus$"):
        prom_env.build()


@pytest.mark.apiserver
@pytest.mark.parametrize(
    ("flags", "names"),
    [
        ((), {"etcd", "kube-apiserver"}),
        (("--controller-manager",), {"etcd", "kube-apiserver", "kube-controller-manager"}),
    ],
)
def test_start_then_stop_leaves_no_process(
    tmp_path: Path, flags: tuple[str, ...], names: set[str]
) -> None:
    state_dir = tmp_path / "testenv"
    module = [sys.executable, "-m", "testenv"]  # from the checkout's root, as `make demo` runs it
    started = subprocess.run(
        [*module, "start", "--dir", str(state_dir), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr
    pids: dict[str, int] = json.loads((state_dir / "state.json").read_text())["pids"]
    try:
        assert pids.keys() == names
        assert all(process_alive(pid, name) for name, pid in pids.items())
        stopped = subprocess.run(
            [*module, "stop", "--dir", str(state_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert (stopped.returncode, stopped.stdout) == (0, "stopped\n"), stopped.stderr
        assert {name: process_alive(pid) for name, pid in pids.items()} == dict.fromkeys(
            names, False
        )
        assert not state_dir.exists()
    finally:
        testenv.stop_processes(pids, timeout=5)


# --- build.sh ---
FAKE_GO = """#!/usr/bin/env bash
# A stand-in for go: records each build, takes a second, writes an executable at -o (or,
# as `go install`, in $GOBIN); `go mod download -json` names $FAKE_GO_MODULE as the source.
if [[ $1 == version ]]; then echo "go version go0.0-fake linux/amd64"; exit 0; fi
if [[ $1 == mod ]]; then printf '{\\n\\t"Dir": "%s",\\n}\\n' "$FAKE_GO_MODULE"; exit 0; fi
echo "build GOTOOLCHAIN=${GOTOOLCHAIN:-} $*" >> "$FAKE_GO_LOG"
out="${GOBIN:-}/gpu-operator"
while [[ $# -gt 0 ]]; do [[ $1 == -o ]] && out=$2; shift; done
sleep 1
printf '#!/bin/sh\\n' > "$out" && chmod +x "$out"
"""


def fake_go_env(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "go").write_text(FAKE_GO)
    (bindir / "go").chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "SHARED_SVC_CACHE": str(tmp_path / "cache"),
        "FAKE_GO_LOG": str(tmp_path / "go.log"),
    }


def builds(tmp_path: Path) -> list[str]:
    log = tmp_path / "go.log"
    return log.read_text().splitlines() if log.exists() else []


def test_builds_of_the_same_inputs_started_at_once_compile_once(tmp_path: Path) -> None:
    assert shutil.which("flock"), "build.sh serializes builds with flock (util-linux)"
    env = fake_go_env(tmp_path)
    runs = [
        subprocess.Popen(
            ["bash", str(BUILD), "1.36"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outputs]
    dirs = {out.strip() for out, _ in outputs}
    assert len(dirs) == 1, dirs
    assert len(builds(tmp_path)) == 3, "kube-apiserver, kube-controller-manager, etcd: once each"
    assert any("waiting for it" in err for _, err in outputs), "the second run waited"
    (directory,) = dirs
    assert sorted(p.name for p in Path(directory).iterdir()) == [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
    ]

    # The cached path: no build at all, the same directory.
    again = subprocess.run(
        ["bash", str(BUILD), "1.36"], env=env, capture_output=True, text=True, check=True
    )
    assert again.stdout.strip() == directory and "cached build" in again.stderr
    assert len(builds(tmp_path)) == 3


def test_each_kubernetes_version_is_a_build_of_its_own_module_file(tmp_path: Path) -> None:
    """build.sh MINOR builds with that version's kube/<MINOR>.mod, into a directory of its
    own, with the machine's Go (no GOTOOLCHAIN); helmrender is one build of its own for all
    of them; an unknown version is a usage error."""
    env = fake_go_env(tmp_path)
    dirs = {}
    for minor in testenv.kube_versions():
        out = subprocess.run(
            ["bash", str(BUILD), minor], env=env, capture_output=True, text=True, check=True
        )
        dirs[minor] = out.stdout.strip()
    assert len(set(dirs.values())) == len(dirs) == 5, dirs
    for minor in testenv.kube_versions():
        mod = REPO / "testenv" / "kube" / f"{minor}.mod"
        mine = [b for b in builds(tmp_path) if f"-modfile={mod} " in b]
        assert len(mine) == 3, builds(tmp_path)
        assert {b.split()[1] for b in mine} == {"GOTOOLCHAIN="}
    helm = [
        subprocess.run(
            ["bash", str(HELMRENDER_BUILD)], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert helm[0] == helm[1] and sorted(p.name for p in Path(helm[0]).iterdir()) == ["helmrender"]
    assert len([b for b in builds(tmp_path) if "-modfile" not in b]) == 1
    bad = subprocess.run(["bash", str(BUILD), "1.30"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == (
        "testenv: usage: build.sh MINOR (a Kubernetes version with a kube/<MINOR>.mod:"
        " 1.33 1.34 1.35 1.36 1.37)\n"
    )


# A stand-in for go whose builds wait for a gate file: it records each build with its
# niceness, then blocks until $FAKE_GO_GATE exists.
GATED_GO = """#!/usr/bin/env bash
if [[ $1 == version ]]; then echo "go version go0.0-fake linux/amd64"; exit 0; fi
out=
for ((i = 1; i <= $#; i++)); do [[ ${!i} == -o ]] && { j=$((i + 1)); out=${!j}; }; done
echo "build nice=$(nice) $out" >> "$FAKE_GO_LOG"
while [[ ! -e $FAKE_GO_GATE ]]; do sleep 0.1; done
printf '#!/bin/sh\\n' > "$out" && chmod +x "$out"
"""


def test_make_test_builds_the_other_versions_in_the_background(tmp_path: Path) -> None:
    """make test's first step returns while the other versions' control planes are still
    building, one after the other at nice 19, into the cache; build.sh of each version run
    after (as the compatibility loop does) finds it built. (One run while the background
    build of its version is in flight waits for it: the test above.)"""
    env = fake_go_env(tmp_path)
    (tmp_path / "bin" / "go").write_text(GATED_GO)
    gate = tmp_path / "gate"
    env["FAKE_GO_GATE"] = str(gate)
    log = tmp_path / "versions.log"
    others = [v for v in testenv.kube_versions() if v != testenv.DEFAULT_KUBE_VERSION]
    make = subprocess.run(
        ["make", "-s", "testenv-versions-background", f"TESTENV_VERSIONS_LOG={log}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # a make that built in the foreground would hang here on the gate
    )
    assert make.returncode == 0, make.stderr
    assert not gate.exists() and not any((tmp_path / "cache").glob("testenv/*/etcd"))
    gate.touch()
    deadline = time.monotonic() + 60  # a bound on the wait, not a measurement
    while log.read_text().count("testenv: built ") < len(others):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    loop = [
        subprocess.run(
            ["bash", str(BUILD), minor], env=env, capture_output=True, text=True, check=True
        )
        for minor in others
    ]
    assert all("cached build" in run.stderr for run in loop), [run.stderr for run in loop]
    assert len({run.stdout for run in loop}) == len(others) == 4
    built = builds(tmp_path)
    assert len(built) == 3 * len(others), built
    assert {b.split()[1] for b in built} == {"nice=19"}
    assert [Path(b.split()[2]).name for b in built] == [
        "kube-apiserver",
        "kube-controller-manager",
        "etcd",
    ] * len(others)
    for minor in others:
        assert f"v{minor}." in log.read_text()


def fake_gpu_operator_module(root: Path) -> Path:
    """The parts of gpu-operator's module source that its build lays out."""
    for d in ("assets/state-dcgm", "manifests/state-x", "deployments/gpu-operator/crds"):
        (root / d).mkdir(parents=True)
    (root / "assets" / "state-dcgm" / "0100_daemonset.yaml").write_text("kind: DaemonSet\n")
    (root / "deployments" / "gpu-operator" / "crds" / "policy.yaml").write_text("kind: CRD\n")
    templates = root / "deployments" / "gpu-operator" / "templates"
    templates.mkdir()
    for name in ("clusterrole.yaml", "role.yaml"):
        (templates / name).write_text(f"# {name}\n")
    return root


def test_gpu_operator_builds_of_the_same_version_started_at_once_build_once(
    tmp_path: Path,
) -> None:
    """gpu-operator/build.sh shares build.sh's cache and lock (testenv/lib.sh)."""
    env = {
        **fake_go_env(tmp_path),
        "FAKE_GO_MODULE": str(fake_gpu_operator_module(tmp_path / "module")),
    }
    runs = [
        subprocess.Popen(
            ["bash", str(GPU_OPERATOR_BUILD)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=60) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outputs]
    dirs = {out.strip() for out, _ in outputs}
    assert len(dirs) == 1, dirs
    # One build: gpu-operator (go install) and, beside it, the build without its upgrade
    # controller (go build of testenv/gpu-operator/no-upgrade/), once each.
    verbs = [line.split()[2] for line in builds(tmp_path)]
    assert verbs == ["install", "build"], builds(tmp_path)
    assert any("waiting for it" in err for _, err in outputs), "the second run waited"
    (directory,) = map(Path, dirs)
    assert directory.parent == tmp_path / "cache" / "gpu-operator"
    assert os.access(directory / "gpu-operator", os.X_OK)
    assert os.access(directory / "gpu-operator-no-upgrade", os.X_OK)
    assert (directory / "opt" / "gpu-operator" / "state-dcgm" / "0100_daemonset.yaml").exists()
    assert (directory / "opt" / "gpu-operator" / "manifests" / "state-x").is_dir()
    assert sorted(p.name for p in (directory / "rbac").iterdir()) == [
        "clusterrole.yaml",
        "role.yaml",
    ]
    assert [p.name for p in (directory / "crds").iterdir()] == ["policy.yaml"]
    assert not list(directory.parent.glob("*.tmp.*")), "no build directory left behind"

    again = subprocess.run(
        ["bash", str(GPU_OPERATOR_BUILD)], env=env, capture_output=True, text=True, check=True
    )
    assert again.stdout.strip() == str(directory) and "cached build" in again.stderr
    assert [line.split()[2] for line in builds(tmp_path)] == verbs  # nothing built again


PARTY_BUILDS = (
    "testenv/prometheus/build.sh",
    "testenv/gpu-operator/build.sh",
    "testenv/prometheus-operator/build.sh",
    "testenv/upgrade-libs/build.sh",
    "testenv/node/base.sh",
    "testenv/node/build.sh",
    "testenv/node/images.sh",
)


def test_make_test_builds_the_parties_in_the_background_before_the_suite() -> None:
    """On a cold machine the parties' builds must not hold up the venv, lint, types and
    the suite (the fixtures wait for a build in flight, tests/test_testenv.py above): in
    ``make test`` every one of them is started in a background chain (a command of its
    own ending in ``&``) before pytest starts, and none runs in the foreground first."""
    make = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert make.returncode == 0, make.stderr
    commands: list[str] = []
    for line in make.stdout.splitlines():  # join the continued lines of one command
        if commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + " " + line.strip()
        else:
            commands.append(line.strip())
    suite = next(i for i, c in enumerate(commands) if "bin/pytest" in c)
    before = commands[:suite]
    for script in PARTY_BUILDS:
        runs = [c for c in before if script in c]
        assert runs, f"{script} is not built before the suite: {before}"
        assert all(c.endswith("&") for c in runs), f"{script} built in the foreground: {runs}"
