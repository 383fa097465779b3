"""A server process: its event loop (uvloop by default, asyncio's on request), and a stop at any moment of its start."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gymrpc.channels import insecure_channel, service_channel_options
from gymrpc.launch.options import server_argv
from gymrpc.servers import bootstrap
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.v1 import registry_service_pb2 as reg_pb
from gymrpc.v1 import registry_service_pb2_grpc as reg_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_auto_is_uvloop_where_installed_and_asyncio_is_asyncios_own() -> None:
    import uvloop

    assert bootstrap.loop_factory("auto") is uvloop.new_event_loop
    assert bootstrap.loop_factory("uvloop") is uvloop.new_event_loop
    assert bootstrap.loop_factory("asyncio") is None


def test_without_uvloop_auto_falls_back_and_an_explicit_choice_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert bootstrap.loop_factory("auto") is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        bootstrap.loop_factory("uvloop")


def test_an_unknown_loop_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="'trio' is not one of auto, uvloop, asyncio"):
        bootstrap.loop_factory("trio")


def _serve_registry(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """Start a registry server process, read its ready file, stop it; (ready file, its log)."""
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "gymrpc.servers.registry", "--token-file", str(tmp_path / "token"),
            "--ready-file", str(ready), "--grace", "0", *flags]  # fmt: skip
    (tmp_path / "token").write_text("t0ken")
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    environment.pop("GYMRPC_REGISTRY", None)
    with subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        assert proc.stderr is not None
        lines: list[str] = []
        for line in proc.stderr:  # the server logs "serving" after it wrote the ready file
            lines.append(line.decode())
            if '"msg": "serving"' in lines[-1]:
                break
        info = json.loads(ready.read_text()) if ready.exists() else {}
        proc.terminate()
        lines += [line.decode() for line in proc.stderr]
        assert proc.wait(timeout=30) == 0, "".join(lines)
    return info, "".join(lines)


def test_a_server_runs_on_uvloop_by_default_and_says_so(tmp_path: Path) -> None:
    info, log = _serve_registry(tmp_path, env={"GYMRPC_EVENT_LOOP": "auto"})
    assert info["event_loop"] == "uvloop", log
    assert '"event_loop": "uvloop"' in log


def test_event_loop_asyncio_runs_asyncios_loop(tmp_path: Path) -> None:
    info, log = _serve_registry(tmp_path, "--event-loop", "asyncio")
    assert info["event_loop"] == "asyncio", log


def test_the_environment_variable_chooses_the_loop(tmp_path: Path) -> None:
    info, log = _serve_registry(tmp_path, env={"GYMRPC_EVENT_LOOP": "asyncio"})
    assert info["event_loop"] == "asyncio", log


def test_a_server_freezes_its_start_up_heap_and_collects_young_objects_less_often(tmp_path: Path) -> None:
    _, log = _serve_registry(tmp_path)
    assert f'"gc_young_threshold": {bootstrap.GC_YOUNG_THRESHOLD}' in log
    probe = (
        "import gc; from gymrpc.servers.bootstrap import settle_heap; before = gc.get_threshold(); settle_heap(); "
        "print(before[1:] == gc.get_threshold()[1:], gc.get_threshold()[0], gc.get_freeze_count() > 1000)"
    )
    done = subprocess.run(  # its own process: a frozen heap would outlive the test in this one
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["True", str(bootstrap.GC_YOUNG_THRESHOLD), "True"], done.stderr


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (["--event-loop", "trio"], {}, "invalid choice: 'trio'"),
        ([], {"GYMRPC_EVENT_LOOP": "trio"}, "event loop 'trio' is not one of auto, uvloop, asyncio"),
    ],
)
def test_a_bad_choice_stops_the_server_before_it_serves(flags: list[str], env: dict[str, str], says: str) -> None:
    argv = [sys.executable, "-m", "gymrpc.servers.registry", *flags]
    done = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_sigterm_while_waiting_for_a_name_stops_at_once_having_served_nothing(tmp_path: Path) -> None:
    """An agent waits for its resources and model to register; `gymrpc down` then must not hang on it."""
    token = tmp_path / "token"
    token.write_text("t0ken")
    ready = tmp_path / "ready.json"

    async def scenario() -> tuple[int, str, list[str]]:
        binding = ServiceBinding(
            reg_pb.DESCRIPTOR.services_by_name["RegistryService"],
            RegistryServicer(),
            reg_grpc.add_RegistryServiceServicer_to_server,
            CONTROL_METHODS,
        )
        registry = await start_server(ServerConfig(name="registry/test", token="t0ken", grace=0), [binding])
        try:
            argv = [sys.executable, "-m", "gymrpc.servers.agent", "--registry", registry.address,
                    "--token-file", str(token), "--ready-file", str(ready),
                    "--resources", "resources/never", "--model", "model/never"]  # fmt: skip
            agent = await asyncio.create_subprocess_exec(
                *argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=asyncio.subprocess.PIPE
            )
            assert agent.stderr is not None
            log = ""
            while "waiting for a name it depends on" not in log:
                line = await agent.stderr.readline()
                assert line, f"the agent exited before it waited: {log}"
                log += line.decode()
            agent.terminate()
            log += (await agent.stderr.read()).decode()
            code = await asyncio.wait_for(agent.wait(), 30)
            async with insecure_channel(registry.address, service_channel_options()) as channel:
                listed = await reg_grpc.RegistryServiceStub(channel).ListEndpoints(reg_pb.ListEndpointsRequest())
            return code, log, [e.name for e in listed.endpoints]
        finally:
            await registry.stop()

    code, log, names = asyncio.run(scenario())
    assert code == 0, log
    assert not ready.exists()  # it never said it was ready
    assert names == []  # and never registered
    assert '"msg": "serving"' not in log


def test_a_stack_config_picks_the_loop_per_server_and_a_bad_one_fails_before_anything_starts() -> None:
    assert server_argv("agent/a", "gymrpc.servers.agent", {"event_loop": "asyncio"}) == ["--event-loop", "asyncio"]
    with pytest.raises(ValueError, match="invalid choice: 'trio'"):
        server_argv("agent/a", "gymrpc.servers.agent", {"event_loop": "trio"})
