"""The backend interface: prompt token ids in, completion token ids and logprobs out.

Backends never see chat messages as text to template: the server renders the
prompt and parses the reply, so every backend is driven by the same token ids.
The shape follows vLLM's `AsyncLLM` (token prompt, DELTA outputs, abort by
request id, a final output with the finish reason), so the in-process vLLM
backend is a thin adapter. `Conversation` is passed along only for backends that
choose replies from the structured chat (the scripted one); others ignore it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gymrpc.errors import GymrpcError, Unimplemented
from gymrpc.servers.model.weights.folder import TensorSpec, WeightsFolder
from gymrpc.servers.model.weights.transfer import TransferInit, unsupported


class Finish(enum.Enum):
    STOP = "stop"
    """A stop token or stop string ended the reply."""
    LENGTH = "length"
    """`max_tokens` (or the context) ran out."""
    ABORT = "abort"
    """The generation was aborted; the tokens so far are kept."""


@dataclass(frozen=True)
class Sampling:
    """Backend-neutral sampling parameters (validated by the server)."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end the turn; the server passes its tokenizer's (`<|im_end|>`, `<|endoftext|>`)."""


@dataclass(frozen=True)
class Conversation:
    """The structured chat the prompt was rendered from (OpenAI-shaped dicts)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] = ()
    rollout_id: str = ""
    default_system: str = ""
    """The system prompt the server's template renders when `messages` has none (chat mode sends it)."""

    def first_user_text(self) -> str:
        return next((m.get("content") or "" for m in self.messages if m.get("role") == "user"), "")

    def assistant_turns(self) -> int:
        """How many assistant replies the conversation already holds: the index of the next one."""
        return sum(1 for m in self.messages if m.get("role") == "assistant")

    def tool_names(self) -> set[str]:
        return {t.get("function", t).get("name", "") for t in self.tools}


@dataclass(frozen=True)
class CompletionDelta:
    """Tokens produced since the previous delta; the last delta of a stream has `finish` set."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    finish: Finish | None = None
    weight_version: str = ""
    sampler: tuple[tuple[bytes, float], ...] = ()
    """Chat mode: the upstream's own (token bytes, logprob) pairs, which `token_ids` (re-tokenised) are not."""


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    """One logprob per token id (of the sampled token), or None if the backend has none."""
    finish: Finish
    weight_version: str
    continued_at: tuple[int, ...] = ()
    """Token offsets where a cut generation was continued by a new backend request (`continue_stream`)."""
    spans: tuple[tuple[str, int, int], ...] = ()
    """(version, first token, last token) of each run of tokens one version produced (`gymrpc.servers.model.spans`)."""
    sampler: tuple[tuple[bytes, float], ...] = ()
    """Chat mode: the upstream's own (token bytes, logprob) pairs (`CompletionDelta.sampler`)."""


@dataclass
class _Accumulator:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)

    def add(self, delta: CompletionDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is None or self.logprobs is None:
            self.logprobs = None
        else:
            self.logprobs.extend(delta.logprobs)


class ModelBackend(abc.ABC):
    """One source of completions. Implementations must be safe for concurrent requests."""

    name: str = "backend"
    retokenized: bool = False
    """True when the token ids are the server's tokenisation of text, not what the model sampled."""

    def status_details(self) -> dict[str, str]:
        """Backend facts shown by `GetStatus` (`gymrpc ctl status`)."""
        return {}

    @abc.abstractmethod
    def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Yield deltas; the last one has `finish` set (ABORT after `abort(request_id)`)."""

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> Completion:
        """The whole completion; by default the stream, accumulated."""
        from gymrpc.servers.model import spans as version_spans

        acc, finish, version = _Accumulator(), Finish.ABORT, ""
        spans: list[tuple[str, int, int]] = []
        sampler: list[tuple[bytes, float]] = []
        async for delta in self.stream(prompt_token_ids, sampling, request_id, conversation=conversation):
            acc.add(delta)
            sampler.extend(delta.sampler)
            version = delta.weight_version or version
            version_spans.extend(spans, version, len(delta.token_ids))
            if delta.finish is not None:
                finish = delta.finish
        logprobs = tuple(acc.logprobs) if acc.logprobs is not None else None
        return Completion(tuple(acc.token_ids), logprobs, finish, version, spans=tuple(spans), sampler=tuple(sampler))

    async def continue_stream(
        self,
        prompt_token_ids: Sequence[int],
        prefix_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Continue a generation cut after `prefix_token_ids`; yields only the new tokens.

        By default the prefix is appended to the prompt and the token budget shrinks by its
        length, which is exact for any backend that takes token prompts (vLLM, `/v1/completions`).
        """
        left = sampling.max_tokens - len(prefix_token_ids)
        if left <= 0:
            yield CompletionDelta((), (), Finish.LENGTH, getattr(self, "weight_version", ""))
            return
        budget = dataclasses.replace(sampling, max_tokens=left)
        prompt = [*prompt_token_ids, *prefix_token_ids]
        async for delta in self.stream(prompt, budget, request_id, conversation=conversation):
            yield delta

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """End the request's generation, keeping its tokens so far; False if it is not running."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or engines."""

    # -- weight updates (`gymrpc.servers.model.weights`) ----------------------------------------------
    # An update is staged (read and checked, off the serving path; a failure changes nothing),
    # then applied inside a pause (`freeze`/`thaw` for KEEP). A backend that cannot load
    # weights says why in `weights_unsupported`; updates then fail with UNIMPLEMENTED.

    def weights_unsupported(self) -> str | None:
        """Why this backend cannot load new weights, or None when it can."""
        return f"the {self.name} backend cannot load new weights"

    def weight_specs(self) -> Mapping[str, TensorSpec] | None:
        """The loaded model's tensors as checkpoint files name them; None: nothing to compare with."""
        return None

    async def stage_weights(self, folder: WeightsFolder) -> Any:
        """Read and check `folder` completely; raising here leaves the old weights serving."""
        raise Unimplemented(self.weights_unsupported() or "this backend cannot stage weights")

    async def apply_weights(self, staged: Any, version: str) -> None:
        """Swap in staged weights and name them `version` (called inside the pause)."""
        raise Unimplemented(self.weights_unsupported() or "this backend cannot apply weights")

    async def freeze(self) -> None:  # noqa: B027 - optional hook
        """KEEP: stop sampling with every running generation kept where it is (its KV too)."""

    async def thaw(self) -> None:  # noqa: B027 - optional hook
        """Continue the generations `freeze` stopped."""

    def cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens of the request's latest engine run served from a KV cache; None: unknown."""
        return None

    # -- weights through a weight-transfer engine (`gymrpc.servers.model.weights.transfer`) ----------
    # `InitWeightTransfer` opens a group (`init_transfer`); an update with `transfer` set is checked
    # like a folder, then `apply_weights` gets a `TransferPlan` and receives it inside the pause.

    def transfer_unsupported(self, engine: str | None = None) -> GymrpcError | None:
        """Why this backend cannot open or use the weight-transfer engine `engine` (any, when None)."""
        return unsupported(
            f"the {self.name} backend has no weight-transfer engine: vLLM's NCCL and CUDA IPC engines work with "
            "--backend vllm on CUDA GPUs only; update by path or UploadWeights instead",
            "weight_transfer_engine",
        )

    def transfer_engine(self) -> tuple[str, int]:
        """(the engine this backend can open, `nccl`/`ipc`, or "" for none; inference workers that join)."""
        return "", 0

    def transfer_open(self) -> str | None:
        """The engine whose group is open now, or None."""
        return None

    async def init_transfer(self, init: TransferInit) -> int:
        """Open (or re-open) the group; returns this server's workers in it. Called under the switch's lock."""
        raise self.transfer_unsupported(init.engine) or Unimplemented("this backend cannot open a transfer")
