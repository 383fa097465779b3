"""`gymrpc up / status / down` and the supervisor's restart policy, on real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gymrpc.cli import _alive
from gymrpc.launch.spec import load_stack_spec, parse_stack_spec

ROOT = Path(__file__).resolve().parents[2]
COUNTER = {"servers": [{"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}]}


def gymrpc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gymrpc.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_status_shows_names_addresses_health_and_restarts_then_down_stops_all(start_stack) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(COUNTER)
    stack.kill("resources/counter")
    stack.wait_for("resources/counter", lambda s: s["state"] == "serving" and s["restarts"] == 1)
    status = gymrpc("status", "--run-dir", str(stack.run_dir))
    assert status.returncode == 0, status.stderr
    line = next(ln for ln in status.stdout.splitlines() if "resources/counter" in ln)
    assert "serving" in line
    assert "SERVING" in line
    assert stack.server("resources/counter")["address"] in line
    assert "signal SIGKILL" in line
    as_json = json.loads(gymrpc("status", "--json", "--run-dir", str(stack.run_dir)).stdout)
    assert as_json["health"] == {"registry/main": "SERVING", "resources/counter": "SERVING"}

    pids = [s["pid"] for s in stack.state()["servers"]]
    down = gymrpc("down", "--run-dir", str(stack.run_dir))
    assert down.returncode == 0, down.stderr
    assert stack.process.wait(timeout=30) == 0
    assert not any(_alive(pid) for pid in pids)
    assert stack.state()["state"] == "stopped"
    assert not (stack.run_dir / "registry.addr").exists()
    assert gymrpc("status", "--run-dir", str(stack.run_dir)).returncode == 3


def test_supervisor_gives_up_after_the_restart_budget(start_stack) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack({**COUNTER, "restart": {"max_restarts": 2, "window_seconds": 60, "backoff_seconds": 0.05}})
    for expected in (1, 2):
        stack.kill("resources/counter")
        stack.wait_for("resources/counter", lambda s, n=expected: s["state"] == "serving" and s["restarts"] == n)
    stack.kill("resources/counter")
    failed = stack.wait_for("resources/counter", lambda s: s["state"] == "failed")
    assert failed["restarts"] == 2
    log = (stack.run_dir / "up.log").read_text()
    assert "server died too often; not restarting it" in log


def test_a_second_stack_in_the_same_run_folder_is_refused(start_stack) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(COUNTER)
    again = gymrpc("up", "--run-dir", str(stack.run_dir), str(stack.run_dir / "stack.yaml"), timeout=30)
    assert again.returncode == 1
    assert "already running" in again.stderr
    assert stack.server("resources/counter")["state"] == "serving"


def test_a_server_that_cannot_start_fails_up_with_its_log(run_dir: Path) -> None:
    config = run_dir / "bad.yaml"
    config.write_text(
        yaml.safe_dump({"servers": [{"name": "resources/x", "role": "resources", "args": {"environment": "nope"}}]})
    )
    started = time.monotonic()
    result = gymrpc("up", "--run-dir", str(run_dir), str(config), timeout=90)
    assert result.returncode == 1
    assert "resources/x exited with code 1 while starting" in result.stderr
    assert "unknown environment 'nope'" in result.stderr  # the tail of the server's own log
    assert time.monotonic() - started < 60


def test_detach_returns_once_serving_and_down_stops_it(run_dir: Path) -> None:
    config = run_dir / "stack.yaml"
    config.write_text(yaml.safe_dump(COUNTER))
    up = gymrpc("up", "--detach", "--run-dir", str(run_dir), str(config), timeout=120)
    assert up.returncode == 0, up.stderr
    assert "resources/counter" in up.stdout
    state = json.loads((run_dir / "stack.json").read_text())
    assert state["state"] == "serving"
    down = gymrpc("down", "--run-dir", str(run_dir))
    assert down.returncode == 0
    assert not _alive(state["launcher_pid"])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, "'servers' must list at least one server"),
        ({"servers": [{"name": "x", "role": "resources"}]}, "role/instance"),
        ({"servers": [{"role": "resources"}]}, "needs 'name' and 'role'"),
        ({"servers": [{"name": "a/b", "role": "r"}, {"name": "a/b", "role": "r"}]}, "used twice"),
        ({"servers": [{"name": "a/b", "role": "r", "colour": 1}]}, "unknown keys ['colour']"),
        ({"servers": [{"name": "a/b", "role": "r"}], "restart": {"max": 1}}, "restart:"),
        ({"servers": [{"name": "a/b", "role": "r"}], "launcher": "k8s"}, "launcher 'k8s' is not available"),
        ({"servers": [{"name": "a/b", "role": "r"}], "typo": 1}, "unknown keys ['typo']"),
    ],
)
def test_bad_stack_configs_are_refused_with_the_key_named(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match="stack config") as info:
        parse_stack_spec(config)
    assert message in str(info.value)


def test_missing_or_broken_config_files(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_stack_spec(run_dir / "missing.yaml")
    broken = run_dir / "broken.yaml"
    broken.write_text("servers: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_stack_spec(broken)
    assert load_stack_spec(None).servers  # the embedded default parses


def test_by_default_a_crash_loop_backs_off_and_keeps_trying(start_stack) -> None:  # type: ignore[no-untyped-def]
    policy = {"backoff_seconds": 0.02, "max_backoff_seconds": 0.16, "window_seconds": 600}
    stack = start_stack({**COUNTER, "restart": policy})
    for expected in range(1, 8):  # past the old default budget (5 in 60 s): never `failed`
        stack.kill("resources/counter")
        stack.wait_for("resources/counter", lambda s, n=expected: s["state"] == "serving" and s["restarts"] == n)
    server = stack.server("resources/counter")
    assert server["backoff_s"] == 0.16  # doubled per restart in the window, up to the cap


def test_status_shows_the_backoff_of_a_restarting_server(tmp_path: Path) -> None:
    from gymrpc.launch.status import format_table

    state = {
        "state": "serving",
        "launcher_pid": 1,
        "registry": "unix:/x",
        "servers": [
            {
                "name": "a/b",
                "state": "restarting",
                "pid": None,
                "address": None,
                "restarts": 9,
                "last_exit": "code 1",
                "backoff_s": 12.8,
            },
            {
                "name": "a/c",
                "state": "serving",
                "pid": 2,
                "address": "127.0.0.1:1",
                "restarts": 1,
                "last_exit": None,
                "backoff_s": 0.2,
            },
        ],
    }
    table = format_table(tmp_path, state)
    assert "restarting (backoff 12.8s)" in table
    assert "serving (backoff" not in table


def test_an_agent_is_ready_only_once_the_names_it_depends_on_resolve(run_dir: Path) -> None:
    # Its resources name never registers: the agent never registers or reports SERVING, so
    # `gymrpc up` fails at the start timeout naming the wait, instead of a stack that looks ready.
    config = {
        "servers": [
            {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
            {
                "name": "agent/a",
                "role": "agent",
                "args": {"resources": "resources/never", "model": "model/policy"},
                "start_timeout": 5,
            },
        ]
    }
    path = run_dir / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    done = gymrpc("up", "--run-dir", str(run_dir), str(path), timeout=120)
    assert done.returncode == 1
    assert "agent/a did not become SERVING" in done.stderr
    assert "waiting for a name it depends on to register" in done.stderr
    assert "resources/never" in done.stderr


def test_a_dependency_start_timeout_covers_its_callers() -> None:
    spec = parse_stack_spec(
        {
            "servers": [
                {"name": "model/policy", "role": "model", "args": {"policy": "counter"}, "start_timeout": 900},
                {"name": "agent/a", "role": "agent", "args": {"model": "model/policy"}},
            ]
        }
    )
    assert [s.start_timeout for s in spec.servers] == [900, 960]
