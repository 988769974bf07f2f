"""The node's base image takes its Debian archive from the machine's apt sources (issue 47):
``testenv/node/base.sh`` names no archive host; its ``debian_mirror`` reads the files apt
reads (deb822 ``*.sources``, then one-line ``sources.list`` and ``*.list``), skips disabled
stanzas, other suites and ``deb-src``, and fails when none serves the suite."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BASE = Path(__file__).resolve().parent.parent / "testenv" / "node" / "base.sh"


def mirror(etc: Path) -> subprocess.CompletedProcess[str]:
    """``debian_mirror`` of base.sh, alone (the build itself is not run), over ``etc``."""
    script = BASE.read_text()
    function = script[script.index("debian_mirror() {") : script.index("\n}\n") + 3]
    return subprocess.run(
        ["bash", "-c", f"SUITE=bookworm\n{function}\ndebian_mirror"],
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "SHARED_SVC_APT_ETC": str(etc)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def write(etc: Path, files: dict[str, str]) -> Path:
    (etc / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (etc / name).write_text(text)
    return etc


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "sources.list.d/00-other.sources": "Types: deb\nURIs: http://other.invalid/x\n"
                "Suites: trixie\nComponents: main\n\n"
                "Types: deb\nURIs: http://disabled.invalid/d\nSuites: bookworm\nEnabled: no\n",
                "sources.list.d/debian.sources": "# a comment\nTypes: deb-src deb\n"
                "URIs: http://mirror-a.invalid/debian\n  http://mirror-b.invalid/debian\n"
                "Suites: bookworm bookworm-updates\nComponents: main\n",
            },
            "http://mirror-a.invalid/debian",
        ),
        (
            {
                "sources.list": "deb-src http://src.invalid/debian bookworm main\n"
                "# deb http://commented.invalid/debian bookworm main\n"
                "deb [arch=amd64 signed-by=/k.gpg] http://one-line.invalid/debian bookworm main\n",
            },
            "http://one-line.invalid/debian",
        ),
    ],
)
def test_the_archive_is_the_one_apt_uses(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    found = mirror(write(tmp_path / "apt", files))
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == expected


def test_no_archive_for_the_suite_fails(tmp_path: Path) -> None:
    etc = write(tmp_path / "apt", {"sources.list": "deb http://x.invalid/debian trixie main\n"})
    assert mirror(etc).returncode != 0


def test_base_sh_names_no_archive_host() -> None:
    text = BASE.read_text()
    assert "http://" not in text and "https://" not in text
