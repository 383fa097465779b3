"""Real vLLM on the CPU: throughput through the whole stack, and what a generation cut costs.

Runs in `.venv-vllm` (`bash scripts/vllm-venv.sh`); builds the tiny models it needs (no download).

    cd /work/main && .venv-vllm/bin/python bench/vllm.py [--quick] [--json out.json]

Part 1, the whole stack: registry, counter resources, a `--backend vllm` model server and an
agent, each a process started by the local launcher; this process collects episodes through
`gymrpc.Client`. Two workloads, each with its own agent and vLLM model server, on counter
task 0 (greedy): `counter` runs the tiny model fine-tuned on that task (3 model calls of ~30
tokens, 3 tool calls, reward 1: an agentic episode); `long` runs the random tiny model, which
babbles one reply of `--long-tokens` tokens and ends the episode (generation-bound).
Tokens/s counts completion tokens over wall time.

Part 2, cut and continue, in-process on the random tiny model (the stack stopped first, so the
two engines do not share the 2 cores): a greedy generation of `--cut-tokens` tokens, then the
same generation aborted after k tokens (`VllmBackend.abort`, keeping the partial) and continued
from prompt + partial (`continue_stream`). Reported: the extra wall time against the
uninterrupted generation, how many prompt tokens the continuation recomputed (prompt + partial
minus the prefix-cache hit; the CPU KV block is 128 tokens), and whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# `python bench/vllm.py` puts bench/ first on sys.path, where this file would shadow the vllm package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
if str(ROOT) not in sys.path:  # runnable as `python bench/vllm.py` from anywhere
    sys.path.insert(0, str(ROOT))

from gymrpc.chat import ChatTemplate, default_tokenizer  # noqa: E402
from gymrpc.client import Client  # noqa: E402
from gymrpc.launch.local import LocalLauncher  # noqa: E402
from gymrpc.launch.spec import parse_stack_spec  # noqa: E402
from gymrpc.rollouts import RolloutTask, collect  # noqa: E402
from gymrpc.rollouts.report import percentile  # noqa: E402
from gymrpc.rollouts.tasks import tasks_from_rows  # noqa: E402
from gymrpc.testing.scripted import build_counter_model, counter_rows  # noqa: E402
from gymrpc.testing.tiny_model import build_tiny_model  # noqa: E402

ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048, "kv_cache_gib": 1, "enforce_eager": True}
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")


AGENTS = {"counter": "agent/counter", "long": "agent/long"}


def stack_config(trained: Path, random: Path) -> dict[str, Any]:
    def model(name: str, path: Path) -> dict[str, Any]:
        args = {"backend": "vllm", "model_path": str(path), **ENGINE}
        return {"name": name, "role": "model", "args": args, "start_timeout": 300}

    def agent(name: str, model: str) -> dict[str, Any]:
        return {"name": name, "role": "agent", "args": {"resources": "resources/counter", "model": model}}

    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            model("model/policy", trained),
            model("model/random", random),
            agent(AGENTS["counter"], "model/policy"),
            agent(AGENTS["long"], "model/random"),
        ]
    }


def workload(name: str, long_tokens: int) -> RolloutTask:
    """Counter task 0, greedy; `long` bounds the random model's one reply to `long_tokens`."""
    row = counter_rows()[0]
    row["responses_create_params"].update(temperature=0.0, max_output_tokens=160 if name == "counter" else long_tokens)
    (task,) = tasks_from_rows([row], name)
    return task


async def run_level(client: Client, name: str, base: RolloutTask, concurrency: int, episodes: int) -> dict[str, Any]:
    tasks = [RolloutTask(i, base.task, f"{name}-c{concurrency}") for i in range(episodes)]
    started = time.perf_counter()
    results = await collect(client, tasks, agent=AGENTS[name], concurrency=concurrency)
    wall = time.perf_counter() - started
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, first: {failed[0].error}")
    calls_made = [c for r in results if r.trajectory is not None for c in r.trajectory.model_calls]
    tokens = sum(len(c.tokens.completion_token_ids) for c in calls_made)
    calls = len(calls_made)
    return {
        "workload": name,
        "concurrency": concurrency,
        "episodes": len(results),
        "model_calls": calls,
        "completion_tokens": tokens,
        "wall_s": wall,
        "episodes_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall,
        "p50_ms": percentile([r.latency_s for r in results], 50) * 1e3,
        "mean_reward": statistics.fmean(r.reward or 0.0 for r in results),
    }


async def stack_bench(
    trained: Path, random: Path, levels: list[int], episodes: int, long_tokens: int
) -> list[dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-bench-", dir="/tmp"))  # short: unix socket paths
    launcher = LocalLauncher(parse_stack_spec(stack_config(trained, random), "<bench>"), run_dir)
    started = time.perf_counter()
    await launcher.start()
    print(f"stack serving in {time.perf_counter() - started:.1f} s (two vLLM engines started)", flush=True)
    rows = []
    try:
        async with Client(run_dir=run_dir) as client:
            for name in ("counter", "long"):
                base = workload(name, long_tokens)
                await run_level(client, name, base, 1, 1)  # warm-up (first requests are slow)
                for c in levels:
                    row = await run_level(client, name, base, c, max(episodes, 2 * c))
                    rows.append(row)
                    print(_stack_row(row), flush=True)
    finally:
        await launcher.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


STACK_HEADER = (
    f"{'workload':>8} {'conc':>4} {'episodes':>8} {'calls':>5} {'tokens':>6} {'episodes/s':>10}"
    f" {'tokens/s':>8} {'p50 ms':>8} {'reward':>6}"
)


def _stack_row(r: dict[str, Any]) -> str:
    return (
        f"{r['workload']:>8} {r['concurrency']:>4} {r['episodes']:>8} {r['model_calls']:>5} {r['completion_tokens']:>6}"
        f" {r['episodes_per_s']:>10.2f} {r['tokens_per_s']:>8.0f} {r['p50_ms']:>8.0f} {r['mean_reward']:>6.2f}"
    )


async def cut_bench(model: Path, tokens: int, cuts: list[int], rounds: int) -> list[dict[str, Any]]:
    from gymrpc.servers.model.backends.base import Sampling
    from gymrpc.servers.model.backends.vllm import VllmBackend, VllmOptions

    tokenizer = default_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {}}}]
    story = [{"role": "user", "content": "Tell me a long story about the sea."}]
    prompt = ChatTemplate(tokenizer).render(story, tools).token_ids
    sampling = Sampling(max_tokens=tokens, temperature=0.0, stop_token_ids=tokenizer.stop_token_ids)
    started = time.perf_counter()
    backend = VllmBackend.start(VllmOptions(model=str(model), **ENGINE), tokenizer)
    print(f"in-process engine ready in {time.perf_counter() - started:.1f} s; prompt {len(prompt)} tokens", flush=True)
    serial = iter(range(10**9))

    async def generate(stream: Any, cut_at: int | None = None, request_id: str = "") -> dict[str, Any]:
        """Tokens, wall time, time to the first token, and (if cut) from the abort to the stream's end."""
        ids: list[int] = []
        t0 = time.perf_counter()
        first = aborted = None
        async for delta in stream:
            if first is None and delta.token_ids:
                first = time.perf_counter() - t0
            ids += delta.token_ids
            if cut_at is not None and len(ids) >= cut_at and delta.finish is None:
                aborted = time.perf_counter()
                await backend.abort(request_id)
                cut_at = None
        end = time.perf_counter()
        return {"ids": ids, "s": end - t0, "ttft_s": first, "abort_s": None if aborted is None else end - aborted}

    rows = []
    try:
        await generate(backend.stream(prompt, sampling, "warm"))
        for k in cuts:
            runs = []
            for _ in range(rounds):
                whole = await generate(backend.stream(prompt, sampling, f"whole-{next(serial)}"))
                rid = f"cut-{next(serial)}"
                cut = await generate(backend.stream(prompt, sampling, rid), k, rid)
                partial = cut["ids"]
                rest = await generate(backend.continue_stream(prompt, partial, sampling, rid))
                cached = backend.cached_tokens(rid) or 0
                runs.append(
                    {
                        "uninterrupted_s": whole["s"],
                        "uninterrupted_ttft_s": whole["ttft_s"],
                        "cut_s": cut["s"],
                        "abort_s": cut["abort_s"],
                        "continue_s": rest["s"],
                        "continue_ttft_s": rest["ttft_s"],
                        "extra_ms": (cut["s"] + rest["s"] - whole["s"]) * 1e3,
                        "partial_tokens": len(partial),
                        "refed_tokens": len(prompt) + len(partial),
                        "cached_tokens": cached,
                        "recomputed_tokens": len(prompt) + len(partial) - cached,
                        "identical": partial + rest["ids"] == whole["ids"],
                    }
                )
            median = sorted(runs, key=lambda r: r["extra_ms"])[len(runs) // 2]
            row = {"cut_after": k, "tokens": tokens, "median": median, "rounds": runs}
            rows.append(row)
            print(_cut_row(row), flush=True)
    finally:
        await backend.close()
    return rows


CUT_HEADER = (
    f"{'cut at':>6} {'of':>5} {'whole ms':>8} {'ttft ms':>7} {'cut ms':>7} {'abort ms':>8} {'cont ms':>7}"
    f" {'cont ttft':>9} {'extra ms':>8} {'partial':>7} {'re-fed':>6} {'cached':>6} {'recomputed':>10} {'same':>5}"
)


def _cut_row(row: dict[str, Any]) -> str:
    m = row["median"]

    def ms(key: str, width: int) -> str:
        return f"{m[key] * 1e3:>{width}.1f}" if m[key] is not None else f"{'-':>{width}}"

    return (
        f"{row['cut_after']:>6} {row['tokens']:>5} {ms('uninterrupted_s', 8)} {ms('uninterrupted_ttft_s', 7)}"
        f" {ms('cut_s', 7)} {ms('abort_s', 8)} {ms('continue_s', 7)} {ms('continue_ttft_s', 9)}"
        f" {m['extra_ms']:>8.0f} {m['partial_tokens']:>7} {m['refed_tokens']:>6} {m['cached_tokens']:>6}"
        f" {m['recomputed_tokens']:>10} {all(r['identical'] for r in row['rounds'])!s:>5}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke-test size (about 2 minutes)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default %(default)s)")
    parser.add_argument("-n", "--episodes", type=int, default=32, help="episodes per level (at least 2 x c)")
    parser.add_argument("--long-tokens", type=int, default=256, help="reply length of the `long` workload")
    parser.add_argument("--cut-tokens", type=int, default=512, help="length of the generation that is cut")
    parser.add_argument("--cuts", default="64,256,448", help="cut points, tokens into the generation")
    parser.add_argument("--rounds", type=int, default=3, help="cut rounds per point; the median is shown")
    parser.add_argument("--json", type=Path, help="write all results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.episodes, args.long_tokens = "1,4", 8, 128
        args.cut_tokens, args.cuts, args.rounds = 256, "64,192", 1
    return args


async def main_async(args: argparse.Namespace, models: Path) -> dict[str, Any]:
    started = time.perf_counter()
    random = build_tiny_model(models / "tiny-random")
    trained = build_counter_model(models / "tiny-counter", base=random)
    print(f"tiny models built in {time.perf_counter() - started:.1f} s ({trained.steps} fine-tuning steps)")
    print(STACK_HEADER, flush=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    stack = await stack_bench(models / "tiny-counter", random, levels, args.episodes, args.long_tokens)
    print(CUT_HEADER, flush=True)
    cuts = await cut_bench(random, args.cut_tokens, [int(k) for k in args.cuts.split(",")], args.rounds)
    return {"stack": stack, "cut_and_continue": cuts}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import vllm

    print(
        f"vLLM {vllm.__version__} on the CPU; tiny Qwen2 (0.56M parameters, float32, eager);"
        f" python {platform.python_version()}, {os.cpu_count()} cpus"
    )
    models = Path(tempfile.mkdtemp(prefix="gymrpc-bench-models-"))
    try:
        results = asyncio.run(main_async(args, models))
    finally:
        shutil.rmtree(models, ignore_errors=True)
    if args.json:
        meta = {"vllm": vllm.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), **vars(args)}
        meta["json"] = str(meta["json"])
        args.json.write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM starts its engine with multiprocessing spawn: the guard is required
    sys.exit(main())
