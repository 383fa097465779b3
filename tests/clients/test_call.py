"""`gymrpc call`: any method by stable name or address, JSON in and out, through reflection only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gymrpc import cli

RUN = {
    "task": {
        "input": [{"role": "ROLE_USER", "content": "add 1 then add 2 then get the count"}],
        "env_json": json.dumps({"expected_count": 6, "initial_count": 3}),
    },
    "episode_id": {"rollout_id": "call-1"},
    "policy_version": "test",
}
COUNTER = {
    "servers": [
        {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
        {"name": "model/policy", "role": "model", "args": {"policy": "counter"}},
        {"name": "agent/counter", "role": "agent", "args": {"resources": "resources/counter", "model": "model/policy"}},
    ]
}


def call(capsys: pytest.CaptureFixture[str], run_dir: Path, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["call", "--run-dir", str(run_dir), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys: pytest.CaptureFixture[str], run_dir: Path, *argv: str) -> list[dict]:
    """Every JSON reply of a call that must succeed (a server stream prints several)."""
    code, out, err = call(capsys, run_dir, *argv)
    assert code == 0, err
    return replies(out)


def replies(text: str) -> list[dict]:
    decoder, objects, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        value, at = decoder.raw_decode(text, at)
        objects.append(value)
    return objects


def test_calls_by_name_address_and_registry(start_stack, capsys, tmp_path: Path) -> None:
    stack = start_stack(COUNTER)
    run_dir = stack.run_dir

    code, out, _ = call(capsys, run_dir, "agent/counter", "list")
    services = out.split()
    assert code == 0
    assert services == sorted(services)
    required = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "gymrpc.v1.AgentService"}
    assert required <= set(services)  # the agent also serves ParticipantService once it is a participant
    code, out, _ = call(capsys, run_dir, "agent/counter", "list", "gymrpc.v1.AgentService")
    assert "RunStream(gymrpc.v1.RunStreamRequest) returns (stream gymrpc.v1.RunStreamResponse)" in out

    [reply] = ok(capsys, run_dir, "agent/counter", "gymrpc.v1.AgentService/Run", json.dumps(RUN))
    trajectory = reply["trajectory"]
    assert trajectory["reward"] == 1.0
    assert trajectory["episode_id"] == {"rollout_id": "call-1"}  # proto field names, as grpcurl prints them

    address = stack.server("resources/counter")["address"]
    [reply] = ok(capsys, run_dir, address, "gymrpc.v1.ResourcesService/ListTools")
    assert [t["name"] for t in reply["tools"]] == ["increment_counter", "get_counter_value"]

    [reply] = ok(capsys, run_dir, "registry", "gymrpc.v1.RegistryService/ListEndpoints", "--emit-defaults")
    assert {e["name"] for e in reply["endpoints"]} == {"resources/counter", "model/policy", "agent/counter"}

    # A server stream prints every reply; a request can come from a file.
    request = tmp_path / "run.json"
    request.write_text(json.dumps({"request": {**RUN, "episode_id": {"rollout_id": "call-2"}}}))
    events = ok(capsys, run_dir, "agent/counter", "gymrpc.v1.AgentService/RunStream", f"@{request}")
    assert [next(iter(e)) for e in events] == ["progress"] * (len(events) - 1) + ["trajectory"]
    assert events[-1]["trajectory"]["reward"] == 1.0


def test_control_tokens_and_errors(start_stack, capsys, monkeypatch) -> None:
    stack = start_stack(COUNTER)
    run_dir = stack.run_dir

    # Control calls carry the run folder's token, or $GYMRPC_TOKEN.
    register = json.dumps({"name": "agent/by-hand", "address": "127.0.0.1:9"})
    [reply] = ok(capsys, run_dir, "registry", "gymrpc.v1.RegistryService/Register", register)
    assert reply["endpoint"]["name"] == "agent/by-hand"
    with monkeypatch.context() as env:
        env.setenv("GYMRPC_TOKEN", "wrong")
        code, _, err = call(capsys, run_dir, "registry", "gymrpc.v1.RegistryService/Register", register)
    assert code == 64 + 16
    assert "failed: UNAUTHENTICATED" in err
    assert "the token was wrong" in err
    assert "$GYMRPC_TOKEN" in err  # the hint says where the token comes from

    # Failed calls name the status, the ErrorInfo reason and metadata; exit 64 + code.

    code, _, err = call(capsys, run_dir, "agent/nope", "gymrpc.v1.AgentService/Run")
    assert code == 64 + 5
    assert "NOT_FOUND" in err
    assert "agent/counter" in err

    code, _, err = call(capsys, run_dir, "agent/counter", "gymrpc.v1.AgentService/Run", '{"task": {}}')
    assert code == 64 + 3
    assert "reason: INVALID_REQUEST" in err
    assert 'metadata: {"field": "task.input"}' in err

    # Mistakes in the command line are usage errors (exit 2), caught before anything is sent.
    code, _, err = call(capsys, run_dir, "agent/counter", "gymrpc.v1.AgentService/Walk")
    assert code == 2
    assert "has no method 'Walk'; it has: Run, RunStream" in err

    code, _, err = call(capsys, run_dir, "agent/counter", "gymrpc.v1.AgentService/Run", '{"task": {"inptu": []}}')
    assert code == 2
    assert "does not fit gymrpc.v1.RunRequest" in err
    assert "inptu" in err

    code, _, err = call(capsys, run_dir, "Agent", "list")
    assert code == 2
    assert "expected 'role/instance'" in err


def test_without_a_stack_the_error_says_how_to_start_one(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("GYMRPC_REGISTRY", raising=False)
    code, _, err = call(capsys, tmp_path, "agent/counter", "list")
    assert code == 1
    assert "gymrpc up" in err
