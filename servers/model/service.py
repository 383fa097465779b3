"""`gymrpc.v1.ModelService`: render the chat, run a backend, parse the reply, dedupe by request id.

The servicer, not the backend, templates the prompt and parses tool calls, so the
token ids and the parsed message do not depend on the backend. Tool-call ids are
`call_<t>_<k>`: t is the number of assistant messages already in the request (the
turn), k the call's index in the reply; unique within an episode and the same on
every retry. Each reply's exact ids are remembered (`CompletionMemory`) so the next
turn's prompt starts with this turn's prompt + completion ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from gymrpc.chat import ChatTemplate, ChatTokenizer, CompletionMemory, ParsedReply, parse_reply
from gymrpc.errors import InvalidArgument
from gymrpc.messages import message_from_dict
from gymrpc.servers.model import spans as version_spans
from gymrpc.servers.model.backends.base import Conversation, Finish, ModelBackend
from gymrpc.servers.model.flights import Flight, FlightTable
from gymrpc.servers.model.prompts import PromptTokenizer
from gymrpc.servers.model.requests import Checked, Limits, check_request
from gymrpc.servers.model.weights.switch import WeightSwitch
from gymrpc.v1 import common_pb2
from gymrpc.v1 import model_service_pb2 as pb
from gymrpc.v1 import model_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_FINISH = {
    Finish.STOP: common_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    Finish.ABORT: common_pb2.FINISH_REASON_ABORTED,
}


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(
        self,
        backend: ModelBackend,
        tokenizer: ChatTokenizer,
        *,
        limits: Limits | None = None,
        cache_size: int = 1024,
        system_prompt: str | None = None,
        incremental_prompts: bool = True,
    ) -> None:
        self.backend = backend if isinstance(backend, WeightSwitch) else WeightSwitch(backend)
        """The backend behind a `WeightSwitch`, which puts new weights in while generations run."""
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self.memory = CompletionMemory(cache_size)  # locked: renders recall from worker threads
        kwargs = {} if system_prompt is None else {"default_system": system_prompt}
        self.prompts = PromptTokenizer(tokenizer) if incremental_prompts else None
        """The previous call's pieces come back without tokenising; None renders every call whole (a bench baseline)."""
        chat_tokenizer = tokenizer if self.prompts is None else self.prompts
        self.template = ChatTemplate(chat_tokenizer, memory=self.memory, **kwargs)  # type: ignore[arg-type]
        self.flights = FlightTable(cache_size)
        self.gate: Any = None
        """Checkpoint hooks `admit`, `generate`, `deliver` (`gymrpc.servers.model.participant`), or None."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        flight = self._admit(request, streaming=False)
        return await flight.result()

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        flight = self._admit(request.request, streaming=True)
        async for delta in flight.events():
            yield pb.GenerateStreamResponse(delta=delta)
        yield pb.GenerateStreamResponse(final=await flight.result())

    def _admit(self, request: pb.GenerateRequest, *, streaming: bool) -> Flight:
        checked = check_request(request, self.limits, self.tokenizer.stop_token_ids)
        fingerprint = hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()
        run = self._run
        body = (
            (lambda f: run(f, checked, streaming))
            if self.gate is None
            else self.gate.admit(request, checked, streaming, run)
        )
        flight, new = self.flights.admit(checked.request_id, fingerprint, body)
        if not new:
            log.info("retry of a known request", extra={"request_id": checked.request_id})
        return flight

    async def _run(self, flight: Flight, checked: Checked, streaming: bool) -> None:
        # Tokenising a long prompt takes a while: off the event loop, so health checks and other calls go on.
        rendered = await asyncio.to_thread(self.template.render, checked.messages, checked.tools)
        prompt = rendered.token_ids
        if len(prompt) > self.limits.max_prompt_tokens:
            raise InvalidArgument(
                f"the rendered prompt has {len(prompt)} tokens; this server takes at most "
                f"{self.limits.max_prompt_tokens}",
                metadata={"field": "messages"},
            )
        conversation = Conversation(checked.messages, checked.tools, checked.rollout_id, self.template.default_system)
        args = (prompt, checked.sampling, checked.request_id)
        token_ids: list[int] = []
        logprobs: list[float] | None = []
        finish, version, continued_at = Finish.ABORT, "", ()
        spans: list[version_spans.Span] = []
        sampler: list[tuple[bytes, float]] = []
        if streaming:
            decoder = self.tokenizer.decoder()
            async for delta in self.backend.stream(*args, conversation=conversation):
                token_ids.extend(delta.token_ids)
                sampler.extend(delta.sampler)
                if delta.logprobs is None:
                    logprobs = None
                elif logprobs is not None:
                    logprobs.extend(delta.logprobs)
                finish = delta.finish or finish
                version = delta.weight_version or version
                version_spans.extend(spans, version or self.backend.weight_version, len(delta.token_ids))
                if delta.token_ids:
                    text = decoder.push([t for t in delta.token_ids if t not in self.tokenizer.stop_token_ids])
                    flight.publish(pb.TokenDelta(text=text, token_ids=delta.token_ids, logprobs=delta.logprobs or ()))
        else:
            generate = self.backend.generate if self.gate is None else self.gate.generate
            completion = await generate(*args, conversation=conversation)
            token_ids, finish, version, continued_at = (
                list(completion.token_ids),
                completion.finish,
                completion.weight_version,
                completion.continued_at,
            )
            logprobs = None if completion.logprobs is None else list(completion.logprobs)
            sampler = list(completion.sampler)
            spans = list(completion.spans)
            if not spans:
                version_spans.extend(spans, version or self.backend.weight_version, len(token_ids))
            if token_ids:
                text = self.tokenizer.decode(self.tokenizer.strip_stop(token_ids))
                flight.publish(pb.TokenDelta(text=text, token_ids=token_ids, logprobs=logprobs or ()))
        reply = self._parse(token_ids, checked)
        self.memory.remember(prompt, reply.to_message(), token_ids)
        has_calls = bool(reply.tool_calls) and finish is Finish.STOP
        response = pb.GenerateResponse(
            message=message_from_dict(reply.to_message()),
            tokens=common_pb2.TokenTrace(
                prompt_token_ids=prompt,
                completion_token_ids=token_ids,
                completion_logprobs=logprobs or (),
                token_source=common_pb2.TOKEN_SOURCE_RETOKENIZED
                if self.backend.retokenized
                else common_pb2.TOKEN_SOURCE_SAMPLER,
                continued_at=continued_at,
                sampler_tokens=[token for token, _ in sampler],
                sampler_logprobs=[logprob for _, logprob in sampler],
            ),
            finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS if has_calls else _FINISH[finish],
            weight_version=(spans[-1][0] if spans else version) or self.backend.weight_version,
            usage=common_pb2.Usage(input_tokens=len(prompt), output_tokens=len(token_ids)),
            weight_versions=version_spans.to_pb(spans),
        )
        if self.gate is not None:
            await self.gate.deliver(checked, response)  # held while a checkpoint is open
        flight.finish(response)

    def _parse(self, token_ids: Sequence[int], checked: Checked) -> ParsedReply:
        text = self.tokenizer.decode(self.tokenizer.strip_stop(token_ids))
        if not checked.tools:
            return ParsedReply(content=text)  # no tools offered: call-like text is just text
        turn = sum(1 for m in checked.messages if m["role"] == "assistant")
        return parse_reply(text, id_prefix=f"call_{turn}")

    async def close(self) -> None:
        await self.flights.close()
        await self.backend.close()
