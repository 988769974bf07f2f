"""The command line, one way per thing: a flag for every setting, warnings for unknown
``SHARED_SVC_*`` variables, one missing-subcommand behaviour, one kubeconfig resolution,
plain 80-column help."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared_svc import cli, kubeconfig
from shared_svc.commands.run import load_config
from shared_svc.config import Config, env_names, flag, unknown_env
from shared_svc.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No setting, kubeconfig or cluster from the machine running the tests; the logging
    that ``run`` sets up (its JSON handler on the root logger) undone afterwards."""
    import os

    for key in list(os.environ):
        if key.upper().startswith("SHARED_SVC_") or key in (
            "KUBECONFIG",
            "OPERATOR_NAMESPACE",
            "POD_NAME",
            "KUBERNETES_SERVICE_HOST",
            "KUBERNETES_SERVICE_PORT",
        ):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["run", *argv])


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("{")]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


# --- 1. a flag for every setting ---


def test_every_setting_is_a_run_flag_with_its_default_and_variable() -> None:
    [run] = [p for p in _parsers(cli.build_parser()) if p.prog == "shared-svc run"]
    text = " ".join(run.format_help().split("\nsettings:", 1)[1].split())
    for name in Config.model_fields:
        flagged = re.search(
            re.escape(flag(name)) + r" (\S+) (.*?; env: [A-Z_]+(?: or [A-Z_]+)?)", text
        )
        assert flagged, f"{flag(name)} missing from run --help"
        assert "default:" in flagged.group(2), flagged.group(0)
        for env in env_names(name):
            assert env in flagged.group(2), flagged.group(0)


def test_a_flag_overrides_the_environment_which_overrides_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert load_config(run_args()).port == 8080
    monkeypatch.setenv("SHARED_SVC_PORT", "9001")
    monkeypatch.setenv("OPERATOR_NAMESPACE", "from-env")
    config = load_config(run_args("--port", "9000"))
    assert (config.port, config.namespace) == (9000, "from-env")
    assert load_config(run_args()).port == 9001
    assert load_config(run_args("--namespace", "from-flag")).namespace == "from-flag"


def test_flags_of_every_type() -> None:
    config = load_config(
        run_args(
            "--dry-run",
            "--adopt",
            "false",
            "--upgrade-runtime-classes",
            "nvidia, kata",
            "--coalesce-seconds",
            "0.5",
            "--upgrade-detection",
            "evict",
            "--lease-duration-seconds",
            "20",
        )
    )
    assert config.dry_run is True and config.adopt is False
    assert config.upgrade_runtime_classes == ["nvidia", "kata"]
    assert config.coalesce_seconds == 0.5 and config.lease_duration_seconds == 20.0
    assert config.upgrade_detection == "evict"
    as_json = load_config(run_args("--upgrade-runtime-classes", '["a","b"]'))
    assert as_json.upgrade_runtime_classes == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--port", "99999"], {}, "--port '99999': Input should be less than or equal to 65535"),
        (["--adopt", "maybe"], {}, "--adopt 'maybe': Input should be a valid boolean"),
        (["--selector-mode", "x"], {}, "--selector-mode 'x': Input should be 'auto' or 'app'"),
        ([], {"SHARED_SVC_WRITES_BURST": "0"}, "SHARED_SVC_WRITES_BURST='0': Input should be"),
        ([], {"OPERATOR_NAMESPACE": "Bad"}, "OPERATOR_NAMESPACE='Bad': String should match"),
        # a list variable that is no JSON: pydantic-settings raises SettingsError (a traceback)
        (
            [],
            {"SHARED_SVC_UPGRADE_RUNTIME_CLASSES": "nvidia"},
            "SHARED_SVC_UPGRADE_RUNTIME_CLASSES='nvidia': not JSON",
        ),
        (["--webhook-cert-file", "/x"], {}, "go together"),
    ],
)
def test_a_bad_value_is_one_line_exit_2(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["run", *argv]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("shared-svc: error: invalid configuration: ") and message in line


def test_upgrade_reads_the_same_settings_under_the_same_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["upgrade", "status", "--namespace", "Bad"]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        "shared-svc: error: invalid configuration: --namespace 'Bad': String should match "
        "pattern '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"
    )
    monkeypatch.setenv("SHARED_SVC_UPGRADE_DRIVER_NAME", "Bad_")
    assert cli.main(["upgrade", "configure-gate"]) == 2
    assert "SHARED_SVC_UPGRADE_DRIVER_NAME='Bad_'" in one_line_error(capsys.readouterr().err)
    with pytest.raises(SystemExit):  # the old spellings are gone: one name per setting
        cli.main(["upgrade", "status", "--driver-name", "gpu"])


# --- 2. unknown SHARED_SVC_* variables ---


def test_unknown_variables_are_named_with_the_closest_setting() -> None:
    environ = {
        "SHARED_SVC_PROT": "1",  # typo
        "shared_svc_lease_nam": "x",  # case-insensitive, as the settings are read
        "SHARED_SVC_ZZZZZZZZZZZZ": "1",  # nothing close
        "SHARED_SVC_PORT": "1",  # a setting
        "SHARED_SVC_NAMESPACE": "ns",  # a setting's second name
        "SHARED_SVC_TESTENV_BIN": "/x",  # the dev tooling's
        "SHARED_SVC_KUBE_VERSION": "1.33",  # the test run's Kubernetes (pytest --kube-version)
        "PATH": "/bin",
    }
    assert unknown_env(environ) == [
        "environment variable SHARED_SVC_PROT is not a setting, ignored "
        "(did you mean SHARED_SVC_PORT?)",
        "environment variable SHARED_SVC_ZZZZZZZZZZZZ is not a setting, ignored",
        "environment variable shared_svc_lease_nam is not a setting, ignored "
        "(did you mean SHARED_SVC_LEASE_NAME?)",
    ]


def test_run_logs_a_warning_for_an_unknown_variable_at_start(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "shared_svc", "run", "--kubeconfig", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHARED_SVC_DRYRUN": "true"},
    )
    assert proc.returncode == 2, proc.stderr
    logged = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    warnings = [line for line in logged if line["level"] == "warning"]
    assert [w["msg"] for w in warnings] == [
        "environment variable SHARED_SVC_DRYRUN is not a setting, ignored "
        "(did you mean SHARED_SVC_DRY_RUN?)"
    ], proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"shared-svc: error: kubeconfig {tmp_path / 'none'} does not exist"
    )


def test_a_typo_is_reported_before_the_error_it_may_explain(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARED_SVC_WEBHOOK_CERT_FILE", "/tls.crt")
    monkeypatch.setenv("SHARED_SVC_WEBHOOK_KEY_FLIE", "/tls.key")
    assert cli.main(["run"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == (
        "shared-svc: warning: environment variable SHARED_SVC_WEBHOOK_KEY_FLIE is not a "
        "setting, ignored (did you mean SHARED_SVC_WEBHOOK_KEY_FILE?)"
    )
    assert "go together" in error


def test_upgrade_warns_about_an_unknown_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("SHARED_SVC_UPGRADE_DRIVER", "ofed")
    assert cli.main(["upgrade", "status", "--kubeconfig", str(tmp_path / "none")]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert "SHARED_SVC_UPGRADE_DRIVER is not a setting" in warning
    assert "did you mean SHARED_SVC_UPGRADE_DRIVER_NAME?" in warning
    assert error.endswith("does not exist")


# --- 4. a missing subcommand, at every level ---


@pytest.mark.parametrize("argv", [[], ["upgrade"], ["admission"]])
def test_a_missing_subcommand_is_usage_and_error_on_stderr_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    prog = " ".join(["shared-svc", *argv])
    assert err.startswith(f"usage: {prog} ")
    assert err.splitlines()[-1] == (
        f"{prog}: error: the following arguments are required: "
        + ("COMMAND" if not argv else "SUBCOMMAND")
    )


# --- 5. one kubeconfig resolution ---


def _file(path: Path, text: str = "clusters: []\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_kubeconfig_resolution_order(tmp_path: Path) -> None:
    home = tmp_path / "home"
    account = tmp_path / "sa"
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    _file(account / "token", "t")
    resolve = kubeconfig.resolve
    # nothing at all: one line naming every way
    with pytest.raises(UsageError, match="no API server configured: pass --kubeconfig") as err:
        resolve(None, {}, home, account)
    assert "\n" not in str(err.value)
    # in a pod: the service account (its environment and its token)
    assert resolve(None, pod, home, account).kind == "in-cluster"
    with pytest.raises(UsageError):
        resolve(None, pod, home, tmp_path / "no-sa")
    # ~/.kube/config before in-cluster
    default = _file(home / ".kube" / "config")
    assert resolve(None, pod, home, account) == kubeconfig.Source(
        "kubeconfig", str(default), "~/.kube/config"
    )
    # $KUBECONFIG (the first file of its list) before ~/.kube/config
    env = {**pod, "KUBECONFIG": f"{tmp_path / 'a'}:{tmp_path / 'b'}"}
    assert resolve(None, env, home, account) == kubeconfig.Source(
        "kubeconfig", str(tmp_path / "a"), ""
    )
    assert resolve(None, {"SHARED_SVC_KUBECONFIG": "/s"}, home, account).path == "/s"
    # --kubeconfig before everything
    assert resolve("/flag", env, home, account) == kubeconfig.Source("kubeconfig", "/flag", "")
    # the setting's variables are these, in this order
    assert env_names("kubeconfig") == kubeconfig.ENV


def _commands_of_the_api(kubeconfig_flag: list[str]) -> Iterator[list[str]]:
    yield ["run", *kubeconfig_flag]
    yield ["upgrade", "status", *kubeconfig_flag]
    yield ["upgrade", "configure-gate", *kubeconfig_flag]
    yield ["admission", "remove", "--policy-binding", "b", *kubeconfig_flag]


def test_every_command_of_the_api_resolves_the_kubeconfig_the_same_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    default = _file(home / ".kube" / "config", "users: []\n")  # no clusters
    for argv in _commands_of_the_api([]):
        assert cli.main(argv) == 2, argv
        assert one_line_error(capsys.readouterr().err) == (
            f"shared-svc: error: kubeconfig {default} (from ~/.kube/config) is not a "
            "kubeconfig (it names no clusters)"
        ), argv
    listed = _file(tmp_path / "first", "users: []\n")
    monkeypatch.setenv("KUBECONFIG", f"{listed}:{default}")
    for argv in _commands_of_the_api([]):
        assert cli.main(argv) == 2, argv
        assert one_line_error(capsys.readouterr().err) == (
            f"shared-svc: error: kubeconfig {listed} is not a kubeconfig (it names no clusters)"
        ), argv
    for argv in _commands_of_the_api(["--kubeconfig", str(tmp_path / "missing")]):
        assert cli.main(argv) == 2, argv
        assert one_line_error(capsys.readouterr().err) == (
            f"shared-svc: error: kubeconfig {tmp_path / 'missing'} does not exist"
        )
    default.unlink()
    monkeypatch.delenv("KUBECONFIG")
    for argv in _commands_of_the_api([]):
        assert cli.main(argv) == 2, argv
        assert "no API server configured" in one_line_error(capsys.readouterr().err)


# --- 6. plain-text help ---


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _parsers(child)


def test_help_is_plain_text_within_80_columns_on_a_wide_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    parsers = list(_parsers(cli.build_parser()))
    assert len(parsers) >= 10  # every command and subcommand
    for parser in parsers:
        text = parser.format_help()
        assert not [line for line in text.splitlines() if len(line) > 80], parser.prog
        assert "\x1b" not in text and "`" not in text, parser.prog


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^    (\S+)", out, re.MULTILINE)
    assert listed == list(cli._COMMANDS)
    for name in ("upgrade", "admission"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        subcommands = re.findall(r"^    (\S+)", capsys.readouterr().out, re.MULTILINE)
        assert subcommands and all(not s.startswith("-") for s in subcommands)
