"""A deterministic backend: replies come from `ReplySource`s, not from a model.

Replies are text in the template's format (tool calls as `<tool_call>` blocks),
tokenized with the server's tokenizer and ended with `<|im_end|>`, so token ids,
logprobs (a constant, 0.0 by default) and finish reasons are real token-level
fields. Streams yield one token per delta, like vLLM's DELTA mode, and honour
`abort`, `max_tokens` and stop strings, so bookkeeping around them can be tested
without a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gymrpc.chat import ChatTokenizer
from gymrpc.errors import FailedPrecondition, GymrpcError
from gymrpc.servers.model.backends.base import CompletionDelta, Conversation, Finish, ModelBackend, Sampling
from gymrpc.servers.model.backends.sources import ReplySource
from gymrpc.servers.model.weights.folder import TensorSpec, WeightsFolder, open_folder
from gymrpc.servers.model.weights.transfer import IPC, NCCL, TransferInit, unsupported


class ScriptedBackend(ModelBackend):
    name = "scripted"

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        sources: Sequence[ReplySource],
        *,
        weight_version: str = "scripted:0",
        fallback: str | None = None,
        logprob: float = 0.0,
        token_delay: float = 0.0,
        weights: Path | None = None,
        simulate_transfer: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.sources = list(sources)
        self.weight_version = weight_version
        self.fallback = fallback
        self.logprob = logprob
        self.token_delay = token_delay
        """Seconds between streamed tokens; lets tests abort or cut a generation midway."""
        self._aborts: dict[str, asyncio.Event] = {}
        self._specs: dict[str, TensorSpec] | None = None if weights is None else open_folder(weights.resolve()).specs()
        """Tensors of the weights "loaded" (`--weights`, then each update's): updates must match them."""
        self.simulate_transfer = simulate_transfer
        """A test double of a weight-transfer engine (`--simulate-weight-transfer`): groups open at once and
        a transfer's tensor list is checked like a real one, then only the version changes. No tensor moves."""
        self._transfer_open: str | None = None

    # -- weight updates: a version bump, checked like a real load ------------------------------

    def weights_unsupported(self) -> str | None:
        return None

    def weight_specs(self) -> Mapping[str, TensorSpec] | None:
        return self._specs

    async def stage_weights(self, folder: WeightsFolder) -> Any:
        return folder

    async def apply_weights(self, staged: Any, version: str) -> None:
        self._specs = staged.specs()  # a folder's, or a simulated transfer's tensor list
        self.weight_version = version

    # -- a weight-transfer engine, simulated (`--simulate-weight-transfer`) only ------------------

    def transfer_unsupported(self, engine: str | None = None) -> GymrpcError | None:
        if not self.simulate_transfer:
            return unsupported(
                "the scripted backend has no weight-transfer engine (it holds no tensors and no GPU): vLLM's NCCL "
                "and CUDA IPC engines need --backend vllm on CUDA GPUs. For tests, --simulate-weight-transfer "
                "checks transfers like vLLM would and only changes the version",
                "weight_transfer_engine",
            )
        return None

    def transfer_engine(self) -> tuple[str, int]:
        return (NCCL, 1) if self.simulate_transfer else ("", 0)

    def transfer_open(self) -> str | None:
        return self._transfer_open

    async def init_transfer(self, init: TransferInit) -> int:
        if (why := self.transfer_unsupported(init.engine)) is not None:
            raise why
        assert init.engine in (NCCL, IPC)
        self._transfer_open = init.engine
        return 1

    def reply_text(self, conversation: Conversation) -> str:
        for source in self.sources:
            text = source.reply(conversation)
            if text is not None:
                return text
        if self.fallback is not None:
            return self.fallback
        sources = ", ".join(s.describe() for s in self.sources)
        raise FailedPrecondition(
            f"no scripted reply for turn {conversation.assistant_turns()} of the conversation starting "
            f"{conversation.first_user_text()[:80]!r} (sources: {sources})",
            reason="NO_SCRIPTED_REPLY",
        )

    def completion_ids(self, text: str, sampling: Sampling) -> tuple[list[int], Finish]:
        for stop in sampling.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        ids = [*self.tokenizer.encode(text), self.tokenizer.im_end_id]
        if len(ids) > sampling.max_tokens:
            return ids[: sampling.max_tokens], Finish.LENGTH
        return ids, Finish.STOP

    async def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        if conversation is None:
            raise FailedPrecondition("the scripted backend needs the conversation, not only token ids")
        ids, finish = self.completion_ids(self.reply_text(conversation), sampling)
        async for delta in self._emit(ids, finish, request_id):
            yield delta

    async def continue_stream(
        self,
        prompt_token_ids: Sequence[int],
        prefix_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """The scripted reply after the prefix; the prefix must be the reply's start."""
        if conversation is None:
            raise FailedPrecondition("the scripted backend needs the conversation, not only token ids")
        ids, finish = self.completion_ids(self.reply_text(conversation), sampling)
        prefix = list(prefix_token_ids)
        if ids[: len(prefix)] != prefix:
            raise FailedPrecondition("the prefix to continue is not the start of the scripted reply")
        async for delta in self._emit(ids[len(prefix) :], finish, request_id):
            yield delta

    async def _emit(self, ids: list[int], finish: Finish, request_id: str) -> AsyncIterator[CompletionDelta]:
        aborted = self._aborts.setdefault(request_id, asyncio.Event())
        try:
            for k, token in enumerate(ids):
                if aborted.is_set():
                    yield CompletionDelta((), (), Finish.ABORT, self.weight_version)
                    return
                last = k == len(ids) - 1
                yield CompletionDelta((token,), (self.logprob,), finish if last else None, self.weight_version)
                await asyncio.sleep(self.token_delay)
            if not ids:
                yield CompletionDelta((), (), finish, self.weight_version)
        finally:
            self._aborts.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        event = self._aborts.get(request_id)
        if event is None:
            return False
        event.set()
        return True
