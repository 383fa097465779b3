"""Weight updates while episodes run: update cost (path vs streamed), throughput with updates, recompute by mode.

    .venv/bin/python bench/weights.py            # about 2-3 min on 2 busy cores
    .venv/bin/python bench/weights.py --quick    # about 1 min

Starts a real stack (`gymrpc up`: counter resources, the scripted model with a per-token delay,
an agent) and measures, in the same run:

1. update cost for a tiny tensor set (~1 M parameters) and a larger synthetic config (~25 M,
   F32, ~100 MB) from a path and streamed: wall time of `update_weights` and the server's
   stage / pause / load durations. The scripted backend reads headers only, so this is the
   transport and checking cost; the vLLM tier's in-process load is measured by
   `tests/vllm/test_weights.py`'s setup and reported in bench/README.md.
2. episodes/s over the same episodes with a KEEP update every `--every` seconds vs none
   (ratio; the goal is >= 0.9).
3. generations kept/cut/drained and tokens recomputed per update, by mode, with episodes in flight.

Figures are ratios against a baseline measured in the same run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.client import Client  # noqa: E402
from gymrpc.rollouts import collect, load_tasks  # noqa: E402
from gymrpc.testing.safetensors_files import synthetic_specs, write_safetensors  # noqa: E402
from gymrpc.weights import update_weights  # noqa: E402

MODEL = "model/policy"


def stack_config(weights: Path, token_delay: float) -> dict[str, Any]:
    model = {"policy": "counter", "weights": str(weights), "token_delay": token_delay}
    return {
        "servers": [
            {"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}},
            {"name": MODEL, "role": "model", "args": model},
            {"name": "agent/simple", "role": "agent", "args": {"resources": "resources/counter", "model": MODEL}},
        ]
    }


def start_stack(run_dir: Path, config: dict[str, Any]) -> subprocess.Popen[bytes]:
    (run_dir / "stack.yaml").write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "gymrpc.cli", "up", "--run-dir", str(run_dir), str(run_dir / "stack.yaml")]
    log = (run_dir / "up.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            state = json.loads((run_dir / "stack.json").read_text())
            if state["state"] == "serving" and state["launcher_pid"] == proc.pid:
                return proc
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        if proc.poll() is not None:
            raise SystemExit((run_dir / "up.log").read_text())
        time.sleep(0.1)
    proc.terminate()
    raise SystemExit("stack did not start in 120 s")


def tensor_set(folder: Path, specs: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", specs)
    return folder


def size_of(specs: dict[str, Any]) -> int:
    params = 0
    for _, shape, _ in specs.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    return params


CONFIGS = {
    "tiny": synthetic_specs(hidden=128, layers=4, vocab=2048),
    "synthetic-25M": synthetic_specs(hidden=640, layers=5, vocab=8192),
}


async def update_costs(run_dir: Path, label: str, folder: Path, rounds: int, log: list[str]) -> None:
    """Best-of-`rounds` cost of one update of `folder`'s tensors, by path and streamed."""
    specs = CONFIGS[label]
    size = (folder / "model.safetensors").stat().st_size
    async with Client(run_dir=run_dir) as client:
        version = 0
        for how in ("path", "stream"):
            walls, stages, pauses = [], [], []
            for _ in range(rounds):
                version += 1
                kwargs = {"path": folder} if how == "path" else {"stream_from": folder}
                started = time.perf_counter()
                reply = await update_weights(client, MODEL, weight_version=f"bench:{version}", **kwargs)
                walls.append(time.perf_counter() - started)
                stages.append(reply.stage_duration.ToNanoseconds() / 1e9)
                pauses.append(reply.pause_duration.ToNanoseconds() / 1e9)
            line = (
                f"UPDATE {label} ({size_of(specs) / 1e6:.1f} M params, {size / 1e6:.1f} MB) {how}: "
                f"wall {min(walls) * 1e3:.1f} ms (best of {rounds}), stage {min(stages) * 1e3:.1f} ms, "
                f"pause {min(pauses) * 1e3:.2f} ms"
            )
            print(line, flush=True)
            log.append(line)


async def throughput(
    client: Client, tasks: list[Any], concurrency: int, every: float | None, folder: Path, tag: str
) -> tuple[float, int]:
    stop = asyncio.Event()
    updates = 0

    async def updater() -> None:
        nonlocal updates
        while every is not None and not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                updates += 1
                await update_weights(client, MODEL, weight_version=f"{tag}:{updates}:{time.time_ns()}", path=folder)

    job = asyncio.ensure_future(updater())
    started = time.perf_counter()
    results = await collect(client, tasks, concurrency=concurrency, repeats=1)
    wall = time.perf_counter() - started
    stop.set()
    await job
    failed = [r for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed: {failed[0].error}")
    return len(results) / wall, updates


async def recompute_by_mode(client: Client, tasks: list[Any], folder: Path, log: list[str]) -> None:
    for mode in ("keep", "cut", "drain"):
        running = _unique(tasks, f"mode-{mode}")
        collection = asyncio.ensure_future(collect(client, running, concurrency=len(running)))
        await asyncio.sleep(0.5)  # episodes generating (the figures count what was in flight)
        version = f"mode-{mode}:{time.time_ns()}"
        reply = await update_weights(client, MODEL, weight_version=version, path=folder, mode=mode)
        await collection
        line = (
            f"MODE {mode}: kept {reply.generations_kept}, cut {reply.generations_cut}, "
            f"drained {reply.generations_drained}, tokens recomputed {reply.tokens_recomputed}, "
            f"pause {reply.pause_duration.ToNanoseconds() / 1e6:.1f} ms"
        )
        print(line, flush=True)
        log.append(line)


async def main_async(args: argparse.Namespace, run_dir: Path, small: Path) -> list[str]:
    log: list[str] = []
    async with Client(run_dir=run_dir) as client:
        base = load_tasks(ROOT / "envs" / "counter" / "data" / "example.jsonl")
        n = args.episodes
        rounds = 1 if args.quick else 3
        ratios = []
        for k in range(rounds):
            many = (base * (n // len(base) + 1))[:n]
            plain, upd = _unique(many, f"plain{k}"), _unique(many, f"upd{k}")
            rate_none, _ = await throughput(client, plain, args.concurrency, None, small, f"none{k}")
            rate_upd, count = await throughput(client, upd, args.concurrency, args.every, small, f"upd{k}")
            ratios.append(rate_upd / rate_none)
            line = (
                f"THROUGHPUT round {k}: {rate_none:.2f} episodes/s without updates, {rate_upd:.2f} with "
                f"{count} KEEP updates (one every {args.every:g} s)"
            )
            print(line, flush=True)
            log.append(line)
        ratio = sorted(ratios)[len(ratios) // 2]
        line = f"RATIO episodes/s with updates / without: {ratio:.3f} (median of {rounds}; goal >= 0.9)"
        print(line, flush=True)
        log.append(line)
        await recompute_by_mode(client, base[:4], small, log)
    return log


def _unique(tasks: list[Any], prefix: str) -> list[Any]:
    """Copies of tasks with distinct episode ids (a repeated id would be answered from the model's cache)."""
    from gymrpc.rollouts.tasks import RolloutTask

    return [RolloutTask(i, t.task, prefix) for i, t in enumerate(tasks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--episodes", type=int, default=60, help="episodes per throughput measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between updates in the throughput run")
    parser.add_argument("--token-delay", type=float, default=0.005, help="the scripted model's seconds per token")
    args = parser.parse_args()
    if args.quick:
        args.episodes = min(args.episodes, 20)
    work = Path(tempfile.mkdtemp(prefix="gymrpc-bw-work-"))
    try:
        for label, specs in CONFIGS.items():  # the scripted model checks updates against its --weights
            folder = tensor_set(work / label, specs)
            with running_stack(stack_config(folder, args.token_delay)) as run_dir:
                asyncio.run(update_costs(run_dir, label, folder, 2 if args.quick else 5, []))
        small = tensor_set(work / "throughput", {"w": ("F32", (64, 64), None)})
        with running_stack(stack_config(small, args.token_delay)) as run_dir:
            asyncio.run(main_async(args, run_dir, small))
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def running_stack(config: dict[str, Any]) -> Iterator[Path]:
    run_dir = Path(tempfile.mkdtemp(prefix="gymrpc-bw-", dir="/tmp"))
    proc = start_stack(run_dir, config)
    try:
        yield run_dir
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
