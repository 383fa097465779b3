"""Run a model server.

python -m gymrpc.servers.model --backend scripted --policy counter
python -m gymrpc.servers.model --backend scripted --script replies.jsonl --recorded example_rollouts.jsonl
python -m gymrpc.servers.model --policy counter --recorded env:blackjack   # an env's bundled recordings
python -m gymrpc.servers.model --backend openai --upstream-url http://127.0.0.1:8011 [--upstream-mode auto|tokens|chat]
python -m gymrpc.servers.model --backend vllm --model-path DIR [--dtype bfloat16] [--tensor-parallel-size 2]
python -m gymrpc.servers.model --policy counter --openai-port 0 --replay-dir DIR   # + the OpenAI HTTP front door

With a control token the server also serves WeightsService: new weights while episodes run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
from pathlib import Path

from gymrpc import auth
from gymrpc.chat import ChatTokenizer, default_tokenizer
from gymrpc.errors import GymrpcError
from gymrpc.servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve
from gymrpc.servers.model.backends.base import ModelBackend
from gymrpc.servers.model.backends.vllm import add_vllm_arguments, model_tokenizer_file
from gymrpc.servers.model.openai_front import OPENAI_LABEL, add_openai_arguments, start_openai
from gymrpc.servers.model.participant import ModelParticipant
from gymrpc.servers.model.requests import Limits
from gymrpc.servers.model.service import ModelServicer
from gymrpc.servers.model.weights.folder import DEFAULT_MAX_TOTAL_BYTES
from gymrpc.servers.model.weights.service import WeightsServicer, weights_binding
from gymrpc.servers.participant import add_participant_arguments, start_plane, wants_participant
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

POLICIES = ("counter",)
ENV_DATA = re.compile(r"env:([a-z][a-z0-9_]*)")


def recorded_path(value: str) -> Path:
    """A `--recorded` value: a file, or `env:NAME` for the rollouts bundled with `envs/NAME`.

    The short form lets a stack config (the embedded default) name packaged data without
    knowing where the package is installed.
    """
    match = ENV_DATA.fullmatch(value)
    if match is None:
        return Path(value)
    try:
        module = importlib.import_module(f"gymrpc.envs.{match.group(1)}")
    except ModuleNotFoundError:
        raise argparse.ArgumentTypeError(f"{value!r}: there is no environment gymrpc.envs.{match.group(1)}") from None
    path = Path(module.__file__ or "").parent / "data" / "example_rollouts.jsonl"
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value!r}: {path} does not exist")
    return path


def build_backend(args: argparse.Namespace, tokenizer: ChatTokenizer) -> ModelBackend:
    if args.backend == "vllm":
        from gymrpc.servers.model.backends.vllm import backend_from_arguments

        return backend_from_arguments(args, tokenizer)  # blocks until the engine can generate
    if args.backend == "openai":
        from gymrpc.servers.model.backends.openai import OpenAIBackend

        key = auth.read_token_file(args.upstream_api_key_file) if args.upstream_api_key_file else None
        return OpenAIBackend(
            args.upstream_url,
            model=args.upstream_model,
            weight_version=args.weight_version or "upstream:0",
            api_key=key or os.environ.get("GYMRPC_UPSTREAM_API_KEY"),
            timeout=args.upstream_timeout,
            dev_abort=args.upstream_dev_abort,
            mode=args.upstream_mode,
            tokenizer=tokenizer,
            weights_model=args.upstream_weights,
            chat_stream=not args.upstream_chat_whole,
        )
    from gymrpc.servers.model.backends.scripted import ScriptedBackend
    from gymrpc.servers.model.backends.sources import CounterSolver, RecordedRollouts, ReplySource, ScriptFile

    sources: list[ReplySource] = [ScriptFile(path) for path in args.script]
    if args.recorded:
        sources.append(RecordedRollouts(args.recorded))
    sources += [CounterSolver() for policy in args.policy if policy == "counter"]
    return ScriptedBackend(
        tokenizer,
        sources,
        weight_version=args.weight_version or "scripted:0",
        fallback=args.fallback,
        token_delay=args.token_delay,
        weights=args.weights,
        simulate_transfer=args.simulate_weight_transfer,
    )


def build_parser() -> argparse.ArgumentParser:
    """The server's options; `gymrpc up` checks stack args against them (and `check_arguments`)."""
    parser = argparse.ArgumentParser(
        prog="python -m gymrpc.servers.model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_arguments(parser, default_name="model/policy")
    parser.add_argument("--backend", choices=("scripted", "openai", "vllm"), default="scripted")
    parser.add_argument("--weight-version", help="reported with every reply (default scripted:0 / upstream:0)")
    parser.add_argument(
        "--tokenizer",
        help="a tokenizer.json (default: the vllm model's own, else gymrpc's shipped tiny tokenizer)",
    )
    parser.add_argument("--system-prompt", help="system text when the conversation has none")
    parser.add_argument("--default-max-tokens", type=int, default=Limits.default_max_tokens)
    parser.add_argument("--max-tokens-limit", type=int, default=Limits.max_tokens)
    parser.add_argument("--max-prompt-tokens", type=int, default=Limits.max_prompt_tokens)
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=Limits.max_prompt_bytes,
        help="larger requests are refused before tokenising (default %(default)s)",
    )
    parser.add_argument("--cache-size", type=int, default=1024, help="replies kept for retries (LRU)")
    parser.add_argument(
        "--incremental-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the token ids of the pieces a conversation's previous call rendered (default on; "
        "--no-incremental-prompts renders every call whole, as a baseline)",
    )
    add_participant_arguments(parser)
    scripted = parser.add_argument_group("scripted backend (sources are tried in the order below)")
    scripted.add_argument("--script", action="append", default=[], help="JSONL of replies (repeatable)")
    scripted.add_argument(
        "--recorded",
        action="append",
        default=[],
        type=recorded_path,
        help="example_rollouts.jsonl to replay, or env:NAME for envs/NAME's bundled one",
    )
    scripted.add_argument("--policy", action="append", default=[], choices=POLICIES, help="built-in policy")
    scripted.add_argument("--fallback", help="reply text when no source knows the turn (default: an error)")
    scripted.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    scripted.add_argument(
        "--weights",
        type=Path,
        help="a safetensors folder standing for the loaded weights: updates must match its tensors",
    )
    scripted.add_argument(
        "--simulate-weight-transfer",
        action="store_true",
        help="test double of a weight-transfer engine: InitWeightTransfer opens at once, transfer updates are "
        "checked like vLLM's (tensor names, dtypes, shapes against --weights), then only the version changes",
    )
    updates = parser.add_argument_group("weight updates (WeightsService; needs the control token)")
    updates.add_argument(
        "--weights-staging-dir",
        type=Path,
        help="where UploadWeights stages streamed files before loading them: this process makes a private "
        "folder in it, removed when it stops (default: $TMPDIR)",
    )
    updates.add_argument(
        "--max-weights-bytes",
        type=int,
        default=DEFAULT_MAX_TOTAL_BYTES,
        help="largest update in bytes, streamed or by path (default %(default)s)",
    )
    updates.add_argument(
        "--weights-root",
        action="append",
        default=[],
        type=Path,
        help="UpdateWeights paths must lie inside this folder (repeatable; default: any absolute path)",
    )
    upstream = parser.add_argument_group("openai backend")
    upstream.add_argument(
        "--upstream-url",
        help="base URL of an OpenAI-compatible server: token-level (vLLM: POST /v1/completions with token-id "
        "prompts and return_token_ids) for training data, or any server with POST /v1/chat/completions "
        "(text and tool calls, re-tokenised here: evaluation only)",
    )
    upstream.add_argument(
        "--upstream-mode",
        choices=("auto", "tokens", "chat"),
        default="auto",
        help="tokens: /v1/completions with token ids (sampler's ids and logprobs, cuts continue from the "
        "streamed tokens); chat: /v1/chat/completions (re-tokenised ids, the sampler's logprobs in its own "
        "tokens where offered, cuts regenerate the message); auto (default): probe the upstream at start, "
        "tokens when it can",
    )
    upstream.add_argument(
        "--upstream-chat-whole",
        action="store_true",
        help="chat mode: ask for whole replies, not streamed ones (upstreams that do not stream)",
    )
    upstream.add_argument("--upstream-model", help="model name (default: the first of /v1/models)")
    upstream.add_argument("--upstream-api-key-file", type=Path, help="file holding the upstream API key")
    upstream.add_argument("--upstream-timeout", type=float, default=600.0)
    upstream.add_argument(
        "--upstream-dev-abort",
        action="store_true",
        help="abort through vLLM's /abort_requests (VLLM_SERVER_DEV_MODE=1), keeping partials",
    )
    upstream.add_argument(
        "--upstream-weights",
        type=Path,
        metavar="MODEL_DIR",
        help="take weight updates through a vLLM upstream's dev endpoints (VLLM_SERVER_DEV_MODE=1, "
        "--worker-extension-cls gymrpc.servers.model.backends.vllm_weights.WeightsExtension); MODEL_DIR is the "
        "safetensors folder it loaded, which updates must match",
    )
    add_vllm_arguments(parser)
    add_openai_arguments(parser)
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse alone cannot say: the options each backend needs."""
    if args.backend == "openai" and not args.upstream_url:
        parser.error("--backend openai needs --upstream-url")
    if args.backend == "scripted" and not (args.script or args.recorded or args.policy or args.fallback):
        parser.error("--backend scripted needs --script, --recorded, --policy or --fallback")
    if args.backend == "vllm" and not args.model_path:
        parser.error("--backend vllm needs --model-path")


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    check_arguments(parser, args)
    config = config_from_arguments(args)
    tokenizer_file = args.tokenizer or (model_tokenizer_file(args.model_path) if args.backend == "vllm" else None)
    tokenizer = ChatTokenizer.from_file(tokenizer_file) if tokenizer_file else default_tokenizer()
    limits = Limits(args.default_max_tokens, args.max_tokens_limit, args.max_prompt_tokens, args.max_prompt_bytes)

    async def main_async() -> None:
        backend = build_backend(args, tokenizer)
        probe = getattr(backend, "probe", None)
        if args.backend == "openai" and probe is not None:
            try:
                await probe()  # fail now, naming what the upstream lacks, rather than at every call
            except GymrpcError as exc:
                await backend.close()
                raise SystemExit(f"model server: {exc.message}") from None
        servicer = ModelServicer(
            backend,
            tokenizer,
            limits=limits,
            cache_size=args.cache_size,
            system_prompt=args.system_prompt,
            incremental_prompts=args.incremental_prompts,
        )
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["ModelService"],
            servicer,
            pb_grpc.add_ModelServiceServicer_to_server,
        )
        bindings, plane = [binding], None
        if wants_participant(args, config):
            plane, control = start_plane(ModelParticipant(servicer), config.name, args)
            bindings.append(control)
        front_door, serving = await start_openai(args, servicer, config.name, config.token), config
        if front_door is not None:  # clients find the front door by the model's stable name
            serving = dataclasses.replace(config, labels={**config.labels, OPENAI_LABEL: front_door.url})
        weights = None
        if config.token:
            weights = WeightsServicer(
                servicer.backend,
                plane=plane,
                staging_dir=args.weights_staging_dir,
                max_total_bytes=args.max_weights_bytes,
                roots=tuple(args.weights_root),
            )
            bindings.append(weights_binding(weights))

        async def stop() -> None:
            if front_door is not None:
                await front_door.close()
            if plane is not None:
                await plane.close()
            await servicer.close()
            if weights is not None:
                weights.close()

        await serve(serving, bindings, on_stop=stop)

    run(f"model:{args.backend}", main_async, args)


if __name__ == "__main__":
    main()
