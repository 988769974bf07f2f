"""The docs tell the truth about the checkout (issues 19 and 23).

README.md, CHANGELOG.md and docs/*.md: every relative link resolves (the anchor too); every
``shared-svc`` command of a README code block that needs no cluster runs and exits 0; every
setting they name is a field of ``Config``; the README's two Mermaid diagrams are well formed
and show what they must; no doc tells the user to turn off gpu-operator's built-in DCGM
steps (no released gpu-operator has that switch: the chart's guard is the way); the version
is one, in ``shared_svc.__version__``. Each check is a function of text, so the tests below
also show each one failing on a broken input.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from shared_svc import __version__
from shared_svc.config import Config
from shared_svc.upgrade.states import FREE_STATES, KEEP_STATES, NOTHING_STATES, RESTORE_STATES
from tests.markdown import LINK, anchors, code_blocks, prose

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SHARED_SVC = Path(sys.executable).parent / "shared-svc"
CODE_DIRS = ("shared_svc", "tests", "testenv", "benchmarks", "scripts", "proptests")
# SHARED_SVC_* variables of the development tooling, not settings (docs/configuration.md).
TOOLING_VARIABLES = {
    "SHARED_SVC_CACHE",
    "SHARED_SVC_TESTENV_BIN",
    "SHARED_SVC_GPU_OPERATOR_DIR",
    "SHARED_SVC_PROMETHEUS_DIR",
    "SHARED_SVC_UPGRADE_LIBS_DIR",
    "SHARED_SVC_PROMETHEUS_OPERATOR_DIR",
    "SHARED_SVC_KUBE_VERSION",
}


def doc_files() -> list[Path]:
    return [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


def docs() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in doc_files()}


def broken_links(files: Mapping[str, str], root: Path) -> list[str]:
    """``file: target`` of each relative link whose file or anchor does not exist.
    ``files`` maps paths relative to ``root`` to their text (others are read from disk)."""
    out = []
    for name, text in sorted(files.items()):
        for target in LINK.findall(prose(text)):
            if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (root / name).parent / path if path else root / name
            rel = str(dest.resolve().relative_to(root.resolve())) if path else name
            if rel in files:
                dest_text: str | None = files[rel]
            elif dest.is_file():
                dest_text = dest.read_text() if dest.suffix == ".md" else None
            elif dest.is_dir() and not anchor:
                continue
            else:
                out.append(f"{name}: {target} (no such file)")
                continue
            if anchor and dest_text is not None and anchor not in anchors(dest_text):
                out.append(f"{name}: {target} (no such heading)")
    return out


def test_every_relative_link_resolves() -> None:
    assert broken_links(docs(), REPO) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "a.md").write_text("# A page\n\n## The `url` value\n")
    files = {
        "README.md": "[ok](pages/a.md#the-url-value) [gone](pages/b.md) "
        "[bad anchor](pages/a.md#nope) [web](https://example.org/x) `[code](pages/c.md)`\n",
        "pages/x.md": "[up](../README.md) [self](#x) \n\n# X\n",
    }
    assert broken_links(files, tmp_path) == [
        "README.md: pages/b.md (no such file)",
        "README.md: pages/a.md#nope (no such heading)",
    ]


# --- The README's commands ---------------------------------------------------------------


def command_lines(text: str) -> list[str]:
    """``shared-svc …`` lines of the shell blocks (comments cut)."""
    out = []
    for info, body in code_blocks(text):
        if info not in ("sh", "shell", "bash", "console"):
            continue
        for line in body.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("shared-svc"):
                out.append(line)
    return out


def needs_no_cluster(argv: list[str]) -> bool:
    """Help and version, and ``plan`` (offline by design): everything else talks to the API."""
    return bool({"--help", "-h", "--version"} & set(argv)) or argv[1:2] == ["plan"]


def test_the_readme_shows_commands_that_need_no_cluster() -> None:
    offline = [c for c in command_lines(README.read_text()) if needs_no_cluster(c.split())]
    assert any("plan" in c for c in offline) and any("--help" in c for c in offline)


@pytest.mark.parametrize(
    "line", [c for c in command_lines(README.read_text()) if needs_no_cluster(c.split())]
)
def test_a_readme_command_that_needs_no_cluster_runs_and_exits_0(line: str) -> None:
    argv = line.split()
    proc = subprocess.run(
        [str(SHARED_SVC), *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout


# --- Settings ----------------------------------------------------------------------------

SNAKE = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`")
VARIABLE = re.compile(r"\bSHARED_SVC_[A-Z0-9_]+\b\*?")


def code_text() -> str:
    """The checkout's Python, this file left out (it names settings to test the check)."""
    here = Path(__file__).resolve()
    return "\n".join(
        p.read_text()
        for d in CODE_DIRS
        for p in sorted((REPO / d).rglob("*.py"))
        if p.resolve() != here
    )


def unknown_settings(files: Mapping[str, str], settings: Iterable[str], code: str) -> list[str]:
    """Names the docs give as settings that no setting has.

    A ``SHARED_SVC_<FIELD>`` variable must be a setting's (or the tooling's; a trailing
    ``*`` is a prefix of some). A snake_case name in backticks must be a setting or a name the
    code still has (a metric, a function, a /status field): a setting that is removed goes from
    ``Config`` and from the code that read it, and its mentions are then found here."""
    fields = set(settings)
    variables = {f"SHARED_SVC_{f.upper()}" for f in fields}
    out = []
    for name, text in sorted(files.items()):
        for var in VARIABLE.findall(text):
            ok = (
                any(v.startswith(var[:-1]) for v in variables)
                if var.endswith("*")
                else var in variables or var in TOOLING_VARIABLES
            )
            if not ok:
                out.append(f"{name}: {var}")
        for word in SNAKE.findall(text):
            if word not in fields and word not in code:
                out.append(f"{name}: {word}")
    return sorted(set(out))


def test_every_setting_the_docs_name_exists() -> None:
    assert unknown_settings(docs(), Config.model_fields, code_text()) == []


def test_a_setting_that_is_gone_is_found() -> None:
    settings = set(Config.model_fields) - {"upgrade_poll_seconds"}
    code = code_text().replace("upgrade_poll_seconds", "")
    text = (REPO / "docs" / "upgrade.md").read_text()
    assert "`upgrade_poll_seconds`" in text
    found = unknown_settings({"docs/upgrade.md": text}, settings, code)
    assert "docs/upgrade.md: upgrade_poll_seconds" in found
    assert unknown_settings(
        {"x.md": "`SHARED_SVC_NO_SUCH`, `SHARED_SVC_WEBHOOK_*`"}, settings, ""
    ) == ["x.md: SHARED_SVC_NO_SUCH"]


# --- The two diagrams --------------------------------------------------------------------

ID = r"[A-Za-z][A-Za-z0-9_]*"
TEXT = r'"[^"]*"'
FLOW_NODE = re.compile(rf"^({ID})(\[{TEXT}\]|\{{\{{{TEXT}\}}\}}|\({TEXT}\))$")
FLOW_EDGE = re.compile(rf"^({ID})\s*(-->|-\.->|==>)\s*(?:\|({TEXT})\|\s*)?({ID})$")
SUBGRAPH = re.compile(rf"^subgraph\s+({ID})(?:\[({TEXT})\])?$")
STATE = re.compile(rf"^state\s+({TEXT})\s+as\s+({ID})$")
TRANSITION = re.compile(rf"^({ID}|\[\*\])\s*-->\s*({ID}|\[\*\])(?:\s*:\s*(.+))?$")


@dataclass
class Diagram:
    kind: str
    nodes: dict[str, str] = field(default_factory=dict)  # id -> text
    parent: dict[str, str] = field(default_factory=dict)  # node id -> subgraph id
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # from, to, label


class DiagramError(ValueError):
    pass


def parse_mermaid(source: str) -> Diagram:
    """The subset of Mermaid the README uses (flowchart, stateDiagram-v2), strictly: every
    line one statement, ids declared once, edges between declared ids, subgraphs closed."""
    lines = [
        ln.strip() for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("%%")
    ]
    if not lines:
        raise DiagramError("empty diagram")
    head, *body = lines
    if re.fullmatch(r"flowchart (LR|RL|TB|TD|BT)", head):
        d = Diagram("flowchart")
        stack: list[str] = []
        for ln in body:
            if m := SUBGRAPH.match(ln):
                sid, title = m.group(1), m.group(2) or m.group(1)
                if sid in d.nodes:
                    raise DiagramError(f"id {sid} declared twice")
                d.nodes[sid] = title.strip('"')
                if stack:
                    d.parent[sid] = stack[-1]
                stack.append(sid)
            elif ln == "end":
                if not stack:
                    raise DiagramError("end without subgraph")
                stack.pop()
            elif m := FLOW_NODE.match(ln):
                nid = m.group(1)
                if nid in d.nodes:
                    raise DiagramError(f"id {nid} declared twice")
                shape = m.group(2)
                d.nodes[nid] = (shape[2:-2] if shape.startswith("{{") else shape[1:-1])[1:-1]
                if stack:
                    d.parent[nid] = stack[-1]
            elif m := FLOW_EDGE.match(ln):
                d.edges.append((m.group(1), m.group(4), (m.group(3) or "").strip('"')))
            else:
                raise DiagramError(f"not a statement: {ln!r}")
        if stack:
            raise DiagramError(f"subgraph {stack[-1]} not closed")
    elif head == "stateDiagram-v2":
        d = Diagram("state")
        for ln in body:
            if m := STATE.match(ln):
                if m.group(2) in d.nodes:
                    raise DiagramError(f"id {m.group(2)} declared twice")
                d.nodes[m.group(2)] = m.group(1).strip('"')
            elif m := TRANSITION.match(ln):
                d.edges.append((m.group(1), m.group(2), (m.group(3) or "").strip()))
            elif not re.fullmatch(r"direction (LR|RL|TB|BT)", ln):
                raise DiagramError(f"not a statement: {ln!r}")
    else:
        raise DiagramError(f"not a flowchart or stateDiagram-v2: {head!r}")
    for a, b, _ in d.edges:
        for end in (a, b):
            if end != "[*]" and end not in d.nodes:
                raise DiagramError(f"edge {a} -> {b}: {end} is not declared")
    return d


def readme_diagrams() -> list[Diagram]:
    return [
        parse_mermaid(body) for info, body in code_blocks(README.read_text()) if info == "mermaid"
    ]


def node_with(d: Diagram, text: str) -> str:
    """The one node whose text is ``text``, else the one whose text holds it (ValueError)."""
    exact = [n for n, t in d.nodes.items() if t == text]
    (nid,) = exact or [n for n, t in d.nodes.items() if text in t]
    return nid


def node_named(d: Diagram, name: str) -> str:
    """The one node naming ``name`` as a word (``cordon-required`` is not in ``uncordon-…``)."""
    (nid,) = [
        n for n, t in d.nodes.items() if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", t)
    ]
    return nid


def inside(d: Diagram, nid: str, group: str) -> bool:
    while nid in d.parent:
        nid = d.parent[nid]
        if nid == group:
            return True
    return False


def services_diagram_problems(d: Diagram) -> list[str]:
    """What the picture of the two stacks must show, as edges between the right nodes."""
    problems = []
    texts = " ".join(d.nodes.values()) + " " + " ".join(e[2] for e in d.edges)
    for name in (
        "gpu-operator",
        "shared-svc",
        "kube-apiserver",
        "admission guard",
        "ClusterPolicy",
        "GPUCluster",
        "ServiceMonitor",
        "nvidia.com/gpu-operator.dcgm=true",
        "nvidia.com/gpu-operator.dcgm-exporter=true",
        "404",
    ):
        if name not in texts:
            problems.append(f"missing {name!r}")
    try:
        op, svc, guard = (
            node_with(d, t) for t in ("gpu-operator", "shared-svc (leader)", "admission guard")
        )
        api = node_with(d, "kube-apiserver")
        services = {
            n: node_with(d, f"Service {n} ")
            for n in (
                "nvidia-dcgm",
                "nvidia-dcgm-exporter",
                "nvidia-dcgm-dra",
                "nvidia-dcgm-exporter-dra",
            )
        }
        legacy, dra = node_with(d, "app=nvidia-dcgm,"), node_with(d, "app=nvidia-dcgm-dra,")
    except ValueError as exc:
        return [*problems, f"a node is missing or not unique: {exc}"]
    group = {d.parent.get(s) for s in services.values()}
    edges = {(a, b) for a, b, _ in d.edges}
    wanted = {
        "gpu-operator writes to the guard": (op, guard),
        "the guard lets through to the Services": (guard, next(iter(group))),
        "shared-svc writes the Services": (svc, next(iter(group))),
        "nvidia-dcgm selects the ClusterPolicy pods": (services["nvidia-dcgm"], legacy),
        "nvidia-dcgm selects the DRA pods": (services["nvidia-dcgm"], dra),
        "nvidia-dcgm-exporter selects the ClusterPolicy pods": (
            services["nvidia-dcgm-exporter"],
            legacy,
        ),
        "nvidia-dcgm-exporter selects the DRA pods": (services["nvidia-dcgm-exporter"], dra),
        "nvidia-dcgm-dra selects the DRA pods": (services["nvidia-dcgm-dra"], dra),
        "nvidia-dcgm-exporter-dra selects the DRA pods": (
            services["nvidia-dcgm-exporter-dra"],
            dra,
        ),
    }
    problems += [what for what, edge in wanted.items() if edge not in edges]
    if len(group) != 1 or None in group:
        problems.append("the four Services are not in one subgraph")
    if not inside(d, guard, api):
        problems.append("the guard is not inside the API server")
    if (services["nvidia-dcgm-dra"], legacy) in edges or (
        services["nvidia-dcgm-exporter-dra"],
        legacy,
    ) in edges:
        problems.append("a -dra name selects the ClusterPolicy pods")
    return problems


MODES = {
    "free": FREE_STATES,
    "keep": KEEP_STATES,
    "restore": RESTORE_STATES,
    "nothing": NOTHING_STATES,
}
GPU_OPERATOR_STATE = re.compile(r"\b[a-z]+(?:-[a-z]+)*-(?:required|done|failed)\b")


def upgrade_diagram_problems(d: Diagram) -> list[str]:
    """The upgrade of one node: gpu-operator's states in order, each in the mode the code
    gives it, what shared-svc frees and restores, the gate and the abort."""
    problems = []
    for nid, text in d.nodes.items():
        m = re.search(r"\((free|keep|restore|nothing|abort)\)", text)
        if not m:
            problems.append(f"state {nid} names no mode")
            continue
        for state in GPU_OPERATOR_STATE.findall(text.split("(")[0]):
            if state not in MODES.get(m.group(1), set()):
                problems.append(
                    f"{state} is not a {m.group(1)} state in shared_svc/upgrade/states.py"
                )
    texts = " ".join(d.nodes.values()) + " " + " ".join(e[2] for e in d.edges)
    for name in (
        "parked label",
        "evicts",
        "gate",
        "GPUConsumersFreed",
        "GPUConsumersRestored",
        "UpgradeAborted",
    ):
        if name not in texts:
            problems.append(f"missing {name!r}")
    path = [
        "upgrade-required",
        "cordon-required",
        "wait-for-jobs-required",
        "pod-restart-required",
        "upgrade-done",
    ]
    succ: dict[str, set[str]] = {}
    for a, b, _ in d.edges:
        succ.setdefault(a, set()).add(b)

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for n in succ.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    try:
        ids = ["[*]", *(node_named(d, s) for s in path), "[*]"]
    except ValueError:
        return [*problems, f"each of {path} must be in one state"]
    problems += [
        f"{b} does not follow {a}" for a, b in itertools.pairwise(ids) if b not in reach(a)
    ]
    return problems


def test_the_readme_has_the_two_diagrams_and_they_parse() -> None:
    services, upgrade = readme_diagrams()
    assert (services.kind, upgrade.kind) == ("flowchart", "state")


def test_the_services_diagram_shows_the_stacks_the_names_and_the_guard() -> None:
    assert services_diagram_problems(readme_diagrams()[0]) == []


def test_the_upgrade_diagram_shows_one_node_in_the_states_of_the_code() -> None:
    assert upgrade_diagram_problems(readme_diagrams()[1]) == []


def test_a_broken_or_wrong_diagram_is_refused() -> None:
    blocks = [b for info, b in code_blocks(README.read_text()) if info == "mermaid"]
    for broken in (
        blocks[0].replace("    end\n", "", 1),  # a subgraph left open
        blocks[0].replace('(stable)"]', '(stable)"', 1),  # a bracket left open
        blocks[1].replace("as gate", "as gat"),  # an edge to an undeclared state
    ):
        with pytest.raises(DiagramError):
            parse_mermaid(broken)
    wrong_selector = parse_mermaid(
        blocks[0].replace("dcgmDra -->", 'dcgmDra -->|"x"| cpPods\n    dcgmDra -->')
    )
    assert "a -dra name selects the ClusterPolicy pods" in services_diagram_problems(wrong_selector)
    no_guard_edge = parse_mermaid(blocks[0].replace('op -->|"PUT, DELETE"| guard', "op --> svc"))
    assert "gpu-operator writes to the guard" in services_diagram_problems(no_guard_edge)
    wrong_mode = parse_mermaid(blocks[1].replace("upgrade-done (restore)", "upgrade-done (keep)"))
    assert upgrade_diagram_problems(wrong_mode) == [
        "upgrade-done is not a keep state in shared_svc/upgrade/states.py"
    ]
    out_of_order = parse_mermaid(blocks[1].replace("drain --> restart", "drain --> keep"))
    assert any("does not follow" in p for p in upgrade_diagram_problems(out_of_order))


# --- What the product no longer needs ------------------------------------------------------

OBSOLETE = (
    # No released gpu-operator can stop writing its DCGM Services: the chart's guard is the way.
    re.compile(r"turn(?:s|ed|ing)?\s+(?:off|back\s+on)\s+(?:the\s+)?gpu-operator'?s?", re.I),
    re.compile(r"gpu-operator'?s\s+(?:own\s+)?built-in", re.I),
    re.compile(r"built-in\s+(?:DCGM\s+)?(?:Service|steps|handling)", re.I),
    re.compile(r"Prerequisite:\s*turn\s+off", re.I),
)


def obsolete_steps(files: Mapping[str, str]) -> list[str]:
    return [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for name, text in sorted(files.items())
        for pattern in OBSOLETE
        for m in pattern.finditer(text)
    ]


def user_facing() -> dict[str, str]:
    chart = REPO / "deploy" / "chart" / "shared-svc"
    extra = [chart / "templates" / "NOTES.txt", chart / "values.yaml"]
    return {**docs(), **{str(p.relative_to(REPO)): p.read_text() for p in extra}}


def test_no_doc_tells_the_user_to_turn_off_gpu_operators_built_in_steps() -> None:
    assert obsolete_steps(user_facing()) == []


def test_the_old_instructions_are_found() -> None:
    old = {
        "README.md": "# Install (gpu-operator's namespace). First turn off gpu-operator's built-in DCGM\n"
        "# Service/ServiceMonitor steps, or shared-svc reports ConflictingWriter and backs off.\n",
        "docs/operations.md": "## Prerequisite: turn off gpu-operator's own DCGM Service handling\n",
        "docs/install.md": "If gpu-operator's built-in handling is turned back on, it recreates\n",
    }
    found = obsolete_steps(old)
    assert {f.split(":")[0] for f in found} == set(old)


# --- One version ---------------------------------------------------------------------------


def test_the_chart_and_the_changelog_carry_the_package_version() -> None:
    chart = yaml.safe_load((REPO / "deploy" / "chart" / "shared-svc" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == __version__, "the newest release in CHANGELOG.md"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = {attr = "shared_svc.__version__"}' in pyproject


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    order = ["## How it works", "## Install", "## Verify", "## Compatibility", "## From a checkout"]
    assert [text.index(h) for h in order] == sorted(text.index(h) for h in order)
    makes = [
        ln.split("#")[0].strip()
        for _, b in code_blocks(text)
        for ln in b.splitlines()
        if ln.startswith("make ")
    ]
    assert makes == ["make demo", "make test"]


# --- What docs/install.md says the chart renders --------------------------------------------


@pytest.mark.helm
def test_with_a_webhook_url_the_deployment_serves_no_webhook_and_the_job_names_the_host() -> None:
    from tests.test_deploy_chart import container_env, find, one, render_docs

    install = (REPO / "docs" / "install.md").read_text()
    assert "### A webhook served elsewhere (`admission.webhook.url`)" in install
    docs = render_docs("admission.webhook.url=https://10.0.0.7:9443")
    assert not [k for k in container_env(docs) if k.startswith("SHARED_SVC_WEBHOOK_")]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert not [v for v in pod.get("volumes", []) if "secret" in v]
    assert not [p for p in pod["containers"][0]["ports"] if p["name"] == "webhook"]
    assert not find(docs, "Service", "shared-svc-webhook")
    urls = sorted(
        w["clientConfig"]["url"]
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
        for config in find(docs, kind)
        for w in config["webhooks"]
    )
    assert urls == ["https://10.0.0.7:9443/mutate", "https://10.0.0.7:9443/validate-delete"]
    (pre,) = [
        j
        for j in find(docs, "Job")
        if j["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    ]
    args = pre["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--san") + 1] == "10.0.0.7"
    assert args[args.index("--secret") + 1] == "gpu-operator/shared-svc-webhook-tls"


@pytest.mark.helm
def test_auto_under_a_render_without_discovery_gives_the_mutating_webhook() -> None:
    from tests.test_deploy_chart import find, render_docs

    kinds = {d["kind"] for d in render_docs()}
    assert "MutatingWebhookConfiguration" in kinds and "MutatingAdmissionPolicy" not in kinds
    policy = render_docs("admission.mutation=policy")
    assert find(policy, "MutatingAdmissionPolicy") and not find(
        policy, "MutatingWebhookConfiguration"
    )
    for doc in ("README.md", "docs/install.md"):
        assert "mutation: policy" in (REPO / doc).read_text(), f"{doc} shows the GitOps values"
