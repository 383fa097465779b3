"""Stack `args` are checked against each server's own options before `gymrpc up` starts anything."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gymrpc.launch.options import arg_flags, server_argv

ROOT = Path(__file__).resolve().parents[2]


def test_false_means_false_and_true_means_true() -> None:
    argv = server_argv(
        "agent/a",
        "gymrpc.servers.agent",
        {"resources": "resources/counter", "require_policy_version": False, "await_restore": True},
    )
    assert argv == ["--resources", "resources/counter", "--no-require-policy-version", "--await-restore"]
    assert server_argv("agent/a", "gymrpc.servers.agent", {"await_restore": False}) == []
    assert server_argv("agent/a", "gymrpc.servers.agent", {"no_require_policy_version": True}) == [
        "--no-require-policy-version"
    ]
    assert server_argv("model/m", "gymrpc.servers.model", {"policy": ["counter"], "script": ["a", "b"]}) == [
        "--policy",
        "counter",
        "--script",
        "a",
        "--script",
        "b",
    ]


def test_a_switch_that_turns_something_off_is_given_when_true() -> None:
    parser = argparse.ArgumentParser()
    off = parser.add_argument("--no-cache", dest="cache", action="store_false")
    assert arg_flags("server m: args.no_cache", "--no-cache", off, True) == ["--no-cache"]
    assert arg_flags("server m: args.no_cache", "--no-cache", off, False) == []


@pytest.mark.parametrize(
    ("module", "args", "says"),
    [
        (
            "gymrpc.servers.model",
            {"model": "/m", "backend": "vllm"},
            "args.model: gymrpc.servers.model has no option --model",
        ),
        ("gymrpc.servers.model", {"backend": "vllm"}, "--backend vllm needs --model-path"),
        ("gymrpc.servers.agent", {"max_steps": "many"}, "invalid int value: 'many'"),
        ("gymrpc.servers.agent", {"require_policy_version": "no"}, "is a switch"),
        ("gymrpc.servers.agent", {"resources": True}, "--resources takes a value"),
        ("gymrpc.servers.resources", {"environment": "counter", "name": "x"}, "args.name: set by the launcher"),
        ("gymrpc.servers.resources", {"checkpoint_verify": "never"}, "invalid choice: 'never'"),
    ],
)
def test_a_wrong_key_or_value_names_the_server_and_key(module: str, args: dict, says: str) -> None:
    with pytest.raises(ValueError, match=r"^server x/y: ") as caught:
        server_argv("x/y", module, args)
    assert says in str(caught.value)


def test_gymrpc_up_refuses_a_bad_stack_before_starting_anything(run_dir: Path) -> None:
    config = {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": "model/policy", "role": "model", "args": {"backend": "vllm", "model": "/models/m"}},
        ]
    }
    path = run_dir / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for detach in ([], ["--detach"]):
        done = subprocess.run(
            [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir), str(path), *detach],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 2, done.stderr
        assert "server model/policy: args.model: gymrpc.servers.model has no option --model" in done.stderr
        assert not (run_dir / "stack.json").exists()
        assert not (run_dir / "registry.addr").exists()


def test_a_module_role_without_a_parser_gets_plain_flags() -> None:
    assert server_argv("x/y", "no_such_module_anywhere", {"a_b": 1, "on": True, "off": False}) == ["--a-b", "1", "--on"]
