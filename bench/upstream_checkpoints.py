"""What a coordinated checkpoint costs with a token-level upstream that cannot abort (episodes/s, extra tokens).

The model server is the real `ModelServicer` + `ModelParticipant` with the openai backend in
`tokens` mode, talking HTTP to a vLLM-style loopback upstream (`tests/model/upstreams.py` in
a process of its own, one token per SSE chunk, `--token-delay` seconds apart, no `/abort_requests`: a cut is the
client disconnecting). Counter episodes run `--concurrency` at a time, the agent loop in this
process, each tool call on a real counter session. Two runs of the same `--episodes`:

- baseline: no checkpoints;
- checkpointed: every `--interval` seconds a model checkpoint (prepare: every generation in
  flight is cut; commit into a fresh folder; resume: each cut continues from its streamed
  tokens as a new completion of prompt + partial).

`--rounds` pairs of runs alternate (each `--episodes / --rounds` episodes) so that load from
other jobs falls on both alike. Reported: episodes/s of each and the median ratio of the pairs
(the issue's goal: >= 0.9), checkpoints taken, generations cut, the pause by phase, upstream
requests and tokens generated beyond the baseline's, per checkpoint, and completions requests
that started over a reply the upstream had already written some of. Both runs see the same
upstream latency, so the ratio is the checkpoints' cost alone.

    .venv/bin/python bench/upstream_checkpoints.py [--quick] [--episodes N] [--concurrency C]
        [--interval S] [--rounds R] [--token-delay S] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.chat import default_tokenizer  # noqa: E402
from gymrpc.control import ControlPlane  # noqa: E402
from gymrpc.envs.counter import CounterEnvironment  # noqa: E402
from gymrpc.messages import task_from_row, task_spec  # noqa: E402
from gymrpc.servers.model.backends.openai import OpenAIBackend  # noqa: E402
from gymrpc.servers.model.participant import ModelParticipant  # noqa: E402
from gymrpc.servers.model.service import ModelServicer  # noqa: E402
from gymrpc.v1 import common_pb2  # noqa: E402
from gymrpc.v1 import model_service_pb2 as pb  # noqa: E402

ROWS = [json.loads(line) for line in (ROOT / "envs/counter/data/example.jsonl").read_text().splitlines() if line]


async def episode(servicer: ModelServicer, n: int) -> float:
    task = task_from_row(ROWS[n % len(ROWS)], str(n))
    session, _ = CounterEnvironment().seed(task_spec(task))
    messages = [common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content=f"Episode {n}."), *task.input]
    for step in range(10):
        request = pb.GenerateRequest(
            request_id=f"e{n}/a0/step{step}",
            episode_id=common_pb2.EpisodeId(rollout_id=f"e{n}"),
            messages=messages,
            tools=task.tools,
            sampling=common_pb2.SamplingParams(temperature=0.0),
        )
        reply = await servicer.Generate(request, None)  # type: ignore[arg-type]
        messages.append(reply.message)
        if not reply.message.tool_calls:
            break
        for call in reply.message.tool_calls:
            result = session.call_tool(call.name, json.loads(call.arguments_json))
            messages.append(
                common_pb2.Message(
                    role=common_pb2.ROLE_TOOL, content=result.output, tool_call_id=call.id, name=call.name
                )
            )
    from gymrpc.messages import messages_to_dicts

    return session.verify(messages_to_dicts(messages)).reward


class UpstreamProcess:
    """The fake upstream in a process of its own, as a real one is (no GIL shared with the model server)."""

    def __init__(self, token_delay: float) -> None:
        argv = [sys.executable, "-m", "tests.model.upstreams", "--tokens-only", "--token-delay", str(token_delay)]
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        if not self.url:
            raise RuntimeError("the fake upstream did not start")

    def stats(self) -> dict[str, int]:
        return httpx.get(self.url.removesuffix("/v1") + "/_stats", timeout=10).json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


async def one_run(args: argparse.Namespace, checkpoints: bool) -> dict[str, Any]:
    upstream = UpstreamProcess(args.token_delay)
    servicer = ModelServicer(OpenAIBackend(upstream.url, mode="tokens", weight_version="bench:0"), default_tokenizer())
    participant = ModelParticipant(servicer)
    plane = ControlPlane(participant, name="model/bench")
    pending = iter(range(args.episodes))
    rewards: list[float] = []
    taken, cut, pauses = 0, 0, []
    phases: list[tuple[float, float, float]] = []

    async def worker() -> None:
        for n in pending:
            rewards.append(await episode(servicer, n))

    async def checkpointer(done: asyncio.Event) -> None:
        nonlocal taken, cut
        with tempfile.TemporaryDirectory(prefix="gymrpc-bench-") as folder:
            while True:
                try:
                    await asyncio.wait_for(done.wait(), args.interval)
                    return
                except TimeoutError:
                    pass
                started = time.perf_counter()
                checkpoint_id = f"c{taken}"
                _, report = await plane.prepare(checkpoint_id, time.time() + 30)
                cut += report.counts.get("cut", 0)
                prepared = time.perf_counter()
                await plane.commit(checkpoint_id, time.time() + 30, f"{folder}/{checkpoint_id}", None)
                committed = time.perf_counter()
                await plane.resume(checkpoint_id)
                pauses.append(time.perf_counter() - started)
                phases.append((prepared - started, committed - prepared, time.perf_counter() - committed))
                taken += 1

    started = time.perf_counter()
    done = asyncio.Event()
    background = asyncio.ensure_future(checkpointer(done)) if checkpoints else None
    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    finally:
        done.set()
        if background is not None:
            await background
        await servicer.close()
        fake = upstream.stats()
        upstream.stop()
    return {
        "episodes": len(rewards),
        "mean_reward": sum(rewards) / max(1, len(rewards)),
        "wall_s": wall,
        "episodes_per_s": len(rewards) / wall,
        "checkpoints": taken,
        "cut_generations": cut,
        "pause_ms_mean": 1000 * sum(pauses) / max(1, len(pauses)),
        "prepare_commit_resume_ms_mean": [1000 * sum(p[i] for p in phases) / max(1, len(phases)) for i in range(3)],
        "upstream_requests": fake["requests"],
        "upstream_tokens": fake["generated_tokens"],
        "continuations": fake["continuations"],
        "regenerations": fake["regenerations"],
        "regenerated_tokens": fake["regenerated_tokens"],
    }


def _total(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one kind summed (counts), their episodes/s over the summed wall time, pauses averaged."""
    out = {k: sum(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], int)}
    out["wall_s"] = sum(r["wall_s"] for r in runs)
    out["episodes_per_s"] = out["episodes"] / out["wall_s"]
    out["mean_reward"] = sum(r["mean_reward"] * r["episodes"] for r in runs) / max(1, out["episodes"])
    weights = [max(1, r["checkpoints"]) for r in runs]
    out["pause_ms_mean"] = sum(r["pause_ms_mean"] * w for r, w in zip(runs, weights, strict=True)) / sum(weights)
    out["prepare_commit_resume_ms_mean"] = [
        sum(r["prepare_commit_resume_ms_mean"][i] * w for r, w in zip(runs, weights, strict=True)) / sum(weights)
        for i in range(3)
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=690)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checkpoints")
    parser.add_argument("--rounds", type=int, default=3, help="paired baseline/checkpointed runs")
    parser.add_argument("--token-delay", type=float, default=0.01, help="upstream seconds per token per stream")
    parser.add_argument("--quick", action="store_true", help="60 episodes, a checkpoint every 0.5 s (smoke test)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.interval, args.rounds = 60, 0.5, 1

    # Rounds alternate baseline and checkpointed runs, so load from other jobs hits both alike;
    # each round's ratio pairs two neighbouring runs, and the median of the ratios is reported.
    rounds = []
    per_round = argparse.Namespace(**{**vars(args), "episodes": max(1, args.episodes // args.rounds)})
    for _ in range(args.rounds):
        rounds.append((asyncio.run(one_run(per_round, False)), asyncio.run(one_run(per_round, True))))
    ratios = sorted(c["episodes_per_s"] / b["episodes_per_s"] for b, c in rounds)
    baseline, checked = (_total([r[i] for r in rounds]) for i in (0, 1))
    per = max(1, checked["checkpoints"])
    figures = {
        "config": {k: getattr(args, k) for k in ("episodes", "rounds", "concurrency", "interval", "token_delay")},
        "baseline": baseline,
        "checkpointed": checked,
        "round_ratios": ratios,
        "throughput_ratio": ratios[len(ratios) // 2],
        "extra_requests_per_checkpoint": (checked["upstream_requests"] - baseline["upstream_requests"]) / per,
        "extra_tokens_per_checkpoint": (checked["upstream_tokens"] - baseline["upstream_tokens"]) / per,
    }
    print(
        f"{args.episodes} counter episodes, {args.concurrency} at a time, "
        f"upstream {args.token_delay * 1000:.0f} ms/token"
    )
    for name in ("baseline", "checkpointed"):
        run = figures[name]
        print(
            f"  {name:12s} {run['episodes_per_s']:7.2f} episodes/s  mean reward {run['mean_reward']:.2f}  "
            f"requests {run['upstream_requests']}  tokens {run['upstream_tokens']}"
        )
    print(
        f"  checkpoints {checked['checkpoints']} (every {args.interval:g} s), "
        f"generations cut {checked['cut_generations']}, "
        f"mean pause {checked['pause_ms_mean']:.1f} ms (prepare/commit/resume "
        + "/".join(f"{v:.1f}" for v in checked["prepare_commit_resume_ms_mean"])
        + " ms)"
    )
    print(
        f"  throughput ratio (checkpointed / baseline), median of {args.rounds} paired rounds: "
        f"{figures['throughput_ratio']:.3f}  (goal >= 0.9; rounds {', '.join(f'{r:.3f}' for r in ratios)})"
    )
    print(
        f"  per checkpoint: {figures['extra_requests_per_checkpoint']:.1f} extra upstream requests, "
        f"{figures['extra_tokens_per_checkpoint']:.1f} extra upstream tokens; "
        f"requests that restarted a reply already partly written by the upstream: {checked['regenerations']}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
