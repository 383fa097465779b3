"""HTTP/JSON twin of `ResourcesService.SeedSession`/`CallTool` for the benchmark (FastAPI + uvicorn).

The reference system's stack: FastAPI routes with pydantic models, served by uvicorn
(uvloop + httptools by default). The routes do the same work as `gymrpc.servers.resources`:
the same id checks, the same argument decoding and the same `SessionHost` running the
counter environment in its thread pool. Run by `bench/unary_rpc.py`:

    python bench/http_counter_server.py --ready-file /tmp/x/http.json [--loop uvloop --http httptools]

Binds 127.0.0.1 on a free port and writes `{"address": "127.0.0.1:PORT", "pid": ...}`
atomically to the ready file once it accepts connections; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from gymrpc.envkit import TaskSpec
from gymrpc.envs.counter import CounterEnvironment
from gymrpc.errors import GymrpcError, InvalidArgument
from gymrpc.ids import check_id
from gymrpc.messages import parse_json_object
from gymrpc.rundir import write_text_atomic
from gymrpc.servers.resources.sessions import EpisodeKey, SessionHost, request_digest


class EpisodeIdBody(BaseModel):
    rollout_id: str
    attempt: int = Field(default=0, ge=0)


class ToolCallBody(BaseModel):
    id: str = ""
    name: str
    arguments_json: str = "{}"


class CallToolBody(BaseModel):
    session_id: str
    episode_id: EpisodeIdBody
    call: ToolCallBody


class CallToolResult(BaseModel):
    output: str
    is_error: bool = False


class TaskBody(BaseModel):
    task_id: str = ""
    env_json: str = "{}"


class SeedSessionBody(BaseModel):
    session_id: str
    episode_id: EpisodeIdBody
    task: TaskBody


class ToolDefinitionBody(BaseModel):
    name: str
    description: str
    parameters_json_schema: str
    strict: bool


class SeedSessionResult(BaseModel):
    tools: list[ToolDefinitionBody]
    observations: list[str] = []


def build_app(workers: int = 8) -> FastAPI:
    """The app: one counter environment, its sessions in a `SessionHost` like the gRPC server's."""
    environment = CounterEnvironment()
    host = SessionHost(environment, workers=workers)
    tools = [
        ToolDefinitionBody(
            name=t.name,
            description=t.description,
            parameters_json_schema=json.dumps(t.parameters, sort_keys=True),
            strict=t.strict,
        )
        for t in environment.tools()
    ]
    tool_names = {t.name for t in tools}
    app = FastAPI()

    @app.exception_handler(GymrpcError)
    async def gymrpc_error(request: Request, exc: GymrpcError) -> JSONResponse:
        return JSONResponse({"code": exc.code.name, "message": str(exc)}, status_code=400)

    def episode(body: EpisodeIdBody) -> EpisodeKey:
        return EpisodeKey(check_id(body.rollout_id, "episode_id.rollout_id"), body.attempt)

    @app.post("/v1/seed_session")
    async def seed_session(body: SeedSessionBody) -> SeedSessionResult:
        session_id = check_id(body.session_id, "session_id")
        fields = parse_json_object(body.task.env_json, "task.env_json")
        spec = TaskSpec(task_id=body.task.task_id, input=[], fields=fields)
        fingerprint = "json:" + body.model_dump_json()
        return await host.seed(
            session_id,
            episode(body.episode_id),
            spec,
            fingerprint,
            lambda observations: SeedSessionResult(tools=tools, observations=list(observations)),
        )

    @app.post("/v1/call_tool")
    async def call_tool(body: CallToolBody) -> CallToolResult:
        session_id = check_id(body.session_id, "session_id")
        key = episode(body.episode_id)
        call = body.call
        if not call.name:
            raise InvalidArgument("call.name is empty")
        arguments, problem = None, None
        if call.name not in tool_names:
            problem = f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(tool_names))}"
        else:
            try:
                arguments = json.loads(call.arguments_json or "{}")
                if not isinstance(arguments, dict):
                    problem = f"Error: arguments of {call.name} must be a JSON object"
            except json.JSONDecodeError as exc:
                problem = f"Error: arguments of {call.name} are not valid JSON: {exc}"
        digest = request_digest(call.name, call.arguments_json)
        result, _ = await host.call_tool(session_id, key, call.id, call.name, arguments, problem, digest=digest)
        return CallToolResult(output=result.output, is_error=result.is_error)

    return app


class _ReadyServer(uvicorn.Server):
    """Writes the ready file once the listening socket is being served."""

    def __init__(self, config: uvicorn.Config, ready_file: Path, address: str) -> None:
        super().__init__(config)
        self._ready_file, self._address = ready_file, address

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            write_text_atomic(self._ready_file, json.dumps({"address": self._address, "pid": os.getpid()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--loop", default="uvloop", choices=["uvloop", "asyncio"])
    parser.add_argument("--http", default="httptools", choices=["httptools", "h11"])
    parser.add_argument("--workers", type=int, default=8, help="environment threads (as gymrpc.servers.resources)")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    host, port = sock.getsockname()
    config = uvicorn.Config(
        build_app(args.workers), loop=args.loop, http=args.http, log_level="warning", access_log=False
    )
    _ReadyServer(config, args.ready_file, f"{host}:{port}").run(sockets=[sock])


if __name__ == "__main__":
    main()
