"""The model role's OpenAI front door against `ModelService.Generate`, and replay against regeneration.

One real model server (`python -m gymrpc.servers.model`, scripted backend, `--openai-port`) in a
subprocess serves both paths from the same servicer and backend; every client runs here.

1. Per-call cost: the same one-turn conversation, sequential calls, through
   - `grpc`: `ModelService.Generate` on a plain grpc.aio stub,
   - `raw`: `POST /v1/chat/completions` over one keep-alive socket (the server's HTTP path alone),
   - `httpx`: the same with httpx (the client library the openai SDK uses),
   - `openai`: the same through the official `openai.AsyncOpenAI` client.
   Configs interleave over rounds; medians per call.
2. A 20-call episode (the conversation grows each call) run live under one run id, then
   the same episode under a new run id: every call answered from the record.
   `--token-delay` makes the scripted backend take that long per token, like a real model.

    .venv/bin/python bench/openai_front.py [--quick] [--token-delay 0.002]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai

from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
REPLY = "The counter now reads fifteen, after adding four and then five to the starting six."
PROMPT = "add 4 then add 5 then get the count"


def nodelay() -> httpx.AsyncHTTPTransport:
    """TCP_NODELAY: without it a POST's body waits for the ACK of its headers (Nagle + delayed ACK, ~40 ms)."""
    return httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_model(folder: Path, token_delay: float) -> tuple[subprocess.Popen[bytes], str, str]:
    ready, port = folder / "ready.json", free_port()
    argv = [
        sys.executable, "-m", "gymrpc.servers.model", "--fallback", REPLY, "--openai-port", str(port),
        "--replay-dir", str(folder / "replay"), "--ready-file", str(ready), "--token-delay", str(token_delay),
        "--no-participant", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the model server did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"], f"http://127.0.0.1:{port}/v1"


async def per_call(address: str, url: str, calls: int, rounds: int) -> dict[str, float]:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "m", "messages": messages}
    request = pb.GenerateRequest(messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content=PROMPT)])
    async with (
        grpc.aio.insecure_channel(address) as channel,
        httpx.AsyncClient(transport=nodelay()) as http,
        openai.AsyncOpenAI(base_url=url, api_key="x", http_client=httpx.AsyncClient(transport=nodelay())) as client,
    ):
        stub = pb_grpc.ModelServiceStub(channel)

        async def via_grpc() -> None:
            request.request_id = uuid.uuid4().hex
            await stub.Generate(request, timeout=30)

        host, _, rest = url.removeprefix("http://").partition(":")
        reader, writer = await asyncio.open_connection(host, int(rest.partition("/")[0]))
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()

        async def via_raw() -> None:
            writer.write(head + payload)
            await writer.drain()
            lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            assert lines[0].split()[1] == b"200", lines[0]
            length = next(
                int(v) for k, _, v in (h.partition(b":") for h in lines[1:]) if k.lower() == b"content-length"
            )
            await reader.readexactly(length)

        async def via_http() -> None:
            (await http.post(f"{url}/chat/completions", json=body)).raise_for_status()

        async def via_openai() -> None:
            await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]

        configs = {"grpc": via_grpc, "raw": via_raw, "httpx": via_http, "openai": via_openai}
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for call in configs.values():
            for _ in range(20):
                await call()  # warm up
        for _ in range(rounds):
            for name, call in configs.items():
                started = time.perf_counter()
                for _ in range(calls):
                    await call()
                samples[name].append((time.perf_counter() - started) / calls)
        writer.close()
    return {name: statistics.median(values) for name, values in samples.items()}


async def episode(url: str, rollout_id: str, run_id: str, calls: int) -> tuple[float, int]:
    """Seconds for `calls` growing-conversation calls of one episode run, and how many were replayed."""
    headers = {"x-gymrpc-episode": f"{rollout_id}/0", "x-gymrpc-run": run_id}
    messages: list[dict[str, str]] = []
    replayed = 0
    http = httpx.AsyncClient(transport=nodelay())
    async with openai.AsyncOpenAI(base_url=url, api_key="x", default_headers=headers, http_client=http) as client:
        started = time.perf_counter()
        for k in range(calls):
            messages.append({"role": "user", "content": f"{PROMPT} (turn {k})"})
            reply = await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            replayed += bool((reply.model_extra or {}).get("gymrpc", {}).get("replayed"))
        return time.perf_counter() - started, replayed


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        proc, address, url = start_model(Path(folder), args.token_delay)
        try:
            costs = await per_call(address, url, args.calls, args.rounds)
            live, regenerated, replay = [], [], []
            for r in range(args.rounds):
                rollout = f"bench-{r}"
                seconds, hits = await episode(url, rollout, "live", args.episode_calls)
                assert hits == 0
                live.append(seconds)
                seconds, hits = await episode(url, f"{rollout}-again", "live", args.episode_calls)
                regenerated.append(seconds)  # the same conversation regenerated in a fresh episode
                seconds, hits = await episode(url, rollout, "retried", args.episode_calls)
                assert hits == args.episode_calls, f"only {hits} of {args.episode_calls} calls were replayed"
                replay.append(seconds)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"per call (median of {args.rounds} rounds x {args.calls} sequential calls, token delay {args.token_delay}s)")
    for name, seconds in costs.items():
        print(f"  {name:7s} {seconds * 1e6:9.0f} us")
    print(f"RATIO raw / grpc: {costs['raw'] / costs['grpc']:.2f}x per-call time")
    print(f"RATIO httpx / grpc: {costs['httpx'] / costs['grpc']:.2f}x per-call time")
    print(f"RATIO openai / grpc: {costs['openai'] / costs['grpc']:.2f}x per-call time")
    print(f"{args.episode_calls}-call episode: generated {statistics.median(regenerated) * 1e3:.1f} ms, ", end="")
    print(f"replayed from the record {statistics.median(replay) * 1e3:.1f} ms")
    print(f"RATIO regenerate / replay: {statistics.median(regenerated) / statistics.median(replay):.2f}x episode time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per config per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--episode-calls", type=int, default=20)
    parser.add_argument("--token-delay", type=float, default=0.0, help="scripted backend seconds per token")
    parser.add_argument("--quick", action="store_true", help="few calls and rounds (the smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds = 20, 2
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
