"""`gymrpc train init|run` (also `python -m gymrpc.train`): the reference GRPO trainer as a command.

    gymrpc train init /tmp/grpo/start                     # the weak start policy (safetensors folder)
    gymrpc --run-dir RUN train run --model /tmp/grpo/start --out /tmp/grpo/out --checkpoint-every 2
    gymrpc --run-dir RUN train run --out /tmp/grpo/out --resume   # after a crash, on a fresh stack

Exit codes of `run`: 0 the target reward was reached (or no target and the budget is spent);
1 the budget was spent below the target; 2 bad arguments or state; 3 no stack to talk to.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gymrpc.rollouts.tasks import RolloutTask, TaskFileError, load_tasks
from gymrpc.train.loop import PLOT, TrainConfig

EXIT_BELOW_TARGET, EXIT_USAGE, EXIT_NO_STACK = 1, 2, 3


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="train_command", required=True)
    init = sub.add_parser("init", help="build the weak start policy: the tiny model on a mixture of near misses")
    init.add_argument("out", type=Path, help="model folder to write")
    init.add_argument("--correct", type=float, default=0.4, help="chance a number is read right (default %(default)s)")
    init.add_argument("--steps", type=_positive, default=300, help="fine-tune steps (default %(default)s)")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(train_func=cmd_init)

    run = sub.add_parser("run", help="train through a running stack: collect, learn, push weights, checkpoint")
    run.add_argument("--run-dir", default=argparse.SUPPRESS, help="the stack's run folder")
    run.add_argument("--model", type=Path, help="start weights (the folder the model server was started with)")
    run.add_argument("--out", type=Path, required=True, help="metrics.csv, reward.png, weights, checkpoints")
    run.add_argument("--tasks", type=Path, help="task file (default: the counter's bundled example tasks)")
    run.add_argument("--resume", action="store_true", help="continue from the newest joint checkpoint in --out")
    run.add_argument("--iterations", type=_positive, default=20, help="budget (default %(default)s)")
    run.add_argument("--target-reward", type=float, help="stop once a batch's mean reward reaches it")
    run.add_argument("--tasks-per-batch", type=_positive, default=5, help="tasks per batch (default %(default)s)")
    run.add_argument("--group-size", type=_positive, default=8, help="episodes per task, G (default %(default)s)")
    run.add_argument("--concurrency", type=_positive, default=64, help="episodes at once (default %(default)s)")
    run.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default %(default)s)")
    run.add_argument(
        "--max-weight", type=float, default=2.0, help="cap on a token's importance weight (default %(default)s)"
    )
    run.add_argument(
        "--kl-beta", type=float, default=0.0, help="k3 KL penalty towards the start weights (default %(default)s)"
    )
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--max-tokens", type=_positive, default=64, help="tokens per model call (default %(default)s)")
    run.add_argument("--max-steps", type=_positive, default=4, help="model calls per episode (default %(default)s)")
    run.add_argument(
        "--max-lag", type=int, choices=(0, 1), default=1, help="1: the next batch runs during the step (default)"
    )
    run.add_argument("--update-mode", choices=("keep", "cut", "drain"), default="keep")
    run.add_argument(
        "--weight-transfer",
        choices=("path", "stream", "nccl"),
        default="path",
        help="how pushed weights reach the model server: path (it reads the saved folder; the default), stream "
        "(the files over gRPC), nccl (the tensors through vLLM's NCCL engine: CUDA, and a model server started "
        "with --weight-transfer nccl)",
    )
    run.add_argument(
        "--transfer-address",
        default="127.0.0.1",
        help="nccl: this trainer's address, which the model server's workers reach (default %(default)s)",
    )
    run.add_argument("--checkpoint-every", type=int, default=0, help="iterations between joint checkpoints (0: off)")
    run.add_argument("--keep-checkpoints", type=_positive, default=2)
    run.add_argument("--agent", default="agent/simple")
    run.add_argument("--model-name", default="model/policy", help="the model server's stable name")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-plot", action="store_true", help="do not write reward.png")
    run.set_defaults(train_func=cmd_run)


def cmd_init(args: argparse.Namespace) -> int:
    from gymrpc.train.warmstart import WeakStart, build_weak_start

    result = build_weak_start(args.out, recipe=WeakStart(correct=args.correct, steps=args.steps, seed=args.seed))
    print(f"wrote {args.out}: {result.steps} steps, loss {result.loss:.4f}, {result.seconds:.1f}s")
    return 0


def cmd_run(args: argparse.Namespace, run_dir: Path | None = None) -> int:
    if args.model is None and not args.resume:
        print("gymrpc train run: --model is needed unless --resume", file=sys.stderr)
        return EXIT_USAGE
    try:
        tasks = load_tasks(args.tasks or _counter_tasks())
    except TaskFileError as exc:
        print(f"gymrpc train run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = TrainConfig(
        out=args.out.absolute(),
        iterations=args.iterations,
        tasks_per_batch=args.tasks_per_batch,
        group_size=args.group_size,
        concurrency=args.concurrency,
        agent=args.agent,
        model=args.model_name,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_steps=args.max_steps,
        max_lag=args.max_lag,
        update_mode=args.update_mode,
        weight_transfer=args.weight_transfer,
        transfer_address=args.transfer_address,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        target_reward=args.target_reward,
        seed=args.seed,
    )
    return asyncio.run(_run(args, config, tasks, run_dir))


async def _run(args: argparse.Namespace, config: TrainConfig, tasks: list[RolloutTask], run_dir: Path | None) -> int:
    from gymrpc.client import Client
    from gymrpc.train.loop import Trainer
    from gymrpc.train.policy import Hyper, Policy
    from gymrpc.train.state import StateError

    model = args.model
    if args.resume:
        from gymrpc.rollouts.checkpointing import CheckpointKeeper
        from gymrpc.train.state import TRAINER_DIR

        saved = CheckpointKeeper(config.out / "checkpoints").latest()
        if saved is not None:
            model = saved.folder / TRAINER_DIR / "weights"
        elif model is None:
            print("gymrpc train run: nothing to resume and no --model to start from", file=sys.stderr)
            return EXIT_USAGE
    hyper = Hyper(lr=args.lr, max_weight=args.max_weight, kl_beta=args.kl_beta)
    policy = await asyncio.to_thread(Policy, model, hyper, seed=args.seed)
    try:
        client = Client(run_dir=run_dir)
    except FileNotFoundError as exc:
        print(f"gymrpc train run: no stack: {exc}", file=sys.stderr)
        return EXIT_NO_STACK
    async with client:
        trainer = Trainer(config, client, policy, tasks)
        try:
            outcome = await trainer.run(resume=args.resume)
        except StateError as exc:
            print(f"gymrpc train run: {exc}", file=sys.stderr)
            return EXIT_USAGE
        finally:
            await trainer.close()
    state = outcome.state
    if state.metrics and not args.no_plot:
        from gymrpc.train.plot import reward_curve

        reward_curve(state.metrics, config.out / PLOT, target=args.target_reward)
    last = state.metrics[-1] if state.metrics else None
    final = f"reward {last['reward']:.3f} at iteration {last['iteration'] + 1}" if last else "nothing trained"
    print(f"done: {final}, weights {state.weight_version}; {config.out}")
    if args.target_reward is not None and not outcome.reached:
        return EXIT_BELOW_TARGET
    return 0


def _counter_tasks() -> Path:
    import gymrpc.envs.counter

    return gymrpc.envs.counter.example_tasks_path()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gymrpc.train", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", help="the stack's run folder (default $GYMRPC_RUN_DIR or ./.gymrpc)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.train_command == "run":
        return cmd_run(args, Path(args.run_dir) if args.run_dir else None)
    return int(args.train_func(args))
