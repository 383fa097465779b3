"""The backend every model server runs behind: it puts new weights in while generations run.

`WeightSwitch` wraps the real backend and knows every generation in flight. An update:

- KEEP: `freeze` the engine (vLLM `pause_generation(mode="keep")`: requests and their KV stay),
  apply, `thaw`. Running generations continue under the new weights; nothing is recomputed.
- CUT: close admission (new generations wait), abort each running generation keeping its
  tokens (the engine's cut), apply, reopen; each generation continues from prompt + tokens so
  far under the new weights, inside the same call, so its caller sees one unbroken stream. The
  prefix's KV is computed again except for what the prefix cache still holds.
- DRAIN: close admission, wait for the running generations to finish, apply, reopen.

A caller's own abort (a checkpoint's cut, a retire) passes through and is never continued.
Only one update runs at a time; `idle` lets a checkpoint prepare wait for it, so a
checkpoint never sees weights half-applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gymrpc.errors import GymrpcError, Unavailable
from gymrpc.servers.model.backends.base import CompletionDelta, Conversation, Finish, ModelBackend, Sampling
from gymrpc.servers.model.weights.folder import TensorSpec, WeightsFolder
from gymrpc.servers.model.weights.transfer import TransferInit

HISTORY = 1024
"""Versions `versions` remembers."""
CONTINUE_WAIT = 60.0
"""Seconds an update waits for its cut generations to park, and then to start again."""


class Mode(enum.Enum):
    KEEP = "keep"
    CUT = "cut"
    DRAIN = "drain"


@dataclass
class _Live:
    """One generation in flight through the switch."""

    prompt_tokens: int
    produced: list[int]
    caller_abort: bool = False
    update_cut: bool = False
    was_cut: bool = False
    parked: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an update-cut generation has stopped (or the generation ended)."""
    continued: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a cut generation's continuation produced its first output (or it ended)."""
    recomputed: int = 0


@dataclass(frozen=True)
class Applied:
    """What one update did."""

    previous: str
    version: str
    mode: Mode
    pause_s: float
    load_s: float
    kept: int = 0
    cut: int = 0
    drained: int = 0
    recomputed: int = 0


class WeightSwitch(ModelBackend):
    def __init__(self, inner: ModelBackend) -> None:
        self.inner = inner
        self._open = asyncio.Event()
        self._open.set()
        self._runs: dict[str, _Live] = {}
        self._ended = asyncio.Condition()
        self.lock = asyncio.Lock()
        self.updates = 0
        self.updated_at: float | None = None
        self.history: list[str] = []
        """Versions served since start, oldest first (bounded; see `versions`)."""

    # -- what the wrapped backend is --------------------------------------------------------

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def weight_version(self) -> str:
        return str(getattr(self.inner, "weight_version", ""))

    @property
    def retokenized(self) -> bool:  # type: ignore[override]
        return self.inner.retokenized

    def status_details(self) -> dict[str, str]:
        return self.inner.status_details()

    def __getattr__(self, attr: str) -> Any:
        # What the base class defines is found before this; what a backend overrides is forwarded above.
        if attr == "inner":
            raise AttributeError(attr)
        # Backend-specific extras (vLLM's pause, cached_tokens, engine) stay reachable.
        return getattr(self.inner, attr)

    def weights_unsupported(self) -> str | None:
        return self.inner.weights_unsupported()

    def weight_specs(self) -> Mapping[str, TensorSpec] | None:
        return self.inner.weight_specs()

    def cached_tokens(self, request_id: str) -> int | None:
        return self.inner.cached_tokens(request_id)

    def transfer_unsupported(self, engine: str | None = None) -> GymrpcError | None:
        return self.inner.transfer_unsupported(engine)

    def transfer_engine(self) -> tuple[str, int]:
        return self.inner.transfer_engine()

    def transfer_open(self) -> str | None:
        return self.inner.transfer_open()

    async def init_transfer(self, init: TransferInit) -> int:
        """Open the group; the caller holds `lock`, so no update runs meanwhile."""
        return await self.inner.init_transfer(init)

    def in_flight(self) -> int:
        return len(self._runs)

    async def idle(self) -> None:
        """Return once no update is running (a checkpoint waits here before closing admission)."""
        async with self.lock:
            pass

    # -- generation -------------------------------------------------------------------------

    def stream(
        self,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        return self._live(prompt_token_ids, (), sampling, request_id, conversation)

    def continue_stream(
        self,
        prompt_token_ids: Sequence[int],
        prefix_token_ids: Sequence[int],
        sampling: Sampling,
        request_id: str,
        *,
        conversation: Conversation | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        return self._live(prompt_token_ids, prefix_token_ids, sampling, request_id, conversation)

    async def _live(
        self,
        prompt: Sequence[int],
        prefix: Sequence[int],
        sampling: Sampling,
        request_id: str,
        conversation: Conversation | None,
    ) -> AsyncIterator[CompletionDelta]:
        await self._open.wait()  # a CUT or DRAIN update is loading: start under the new weights
        live = _Live(len(prompt), list(prefix))
        self._runs[request_id] = live
        try:
            continuing = False
            while True:
                if live.produced:
                    source = self.inner.continue_stream(
                        prompt, live.produced, sampling, request_id, conversation=conversation
                    )
                else:
                    source = self.inner.stream(prompt, sampling, request_id, conversation=conversation)
                finish: Finish | None = None
                async for delta in source:
                    if continuing:
                        continuing = False
                        cached = self.inner.cached_tokens(request_id)
                        total = live.prompt_tokens + len(live.produced)
                        live.recomputed = total if cached is None else max(0, total - cached)
                        live.continued.set()
                    live.produced.extend(delta.token_ids)
                    finish = delta.finish or finish
                    if delta.finish is Finish.ABORT and live.update_cut and not live.caller_abort:
                        if delta.token_ids:
                            yield dataclasses.replace(delta, finish=None)
                        continue
                    yield delta
                if not (finish is Finish.ABORT and live.update_cut and not live.caller_abort):
                    return
                live.was_cut = True
                live.parked.set()
                await self._wait_open_or_abort(live)
                if live.caller_abort:
                    yield CompletionDelta((), (), Finish.ABORT, self.weight_version)
                    return
                live.update_cut, continuing = False, True
                live.parked.clear()
        finally:
            if self._runs.get(request_id) is live:
                del self._runs[request_id]
            live.parked.set()
            live.continued.set()
            async with self._ended:
                self._ended.notify_all()

    async def _wait_open_or_abort(self, live: _Live) -> None:
        while not self._open.is_set() and not live.caller_abort:
            opened = asyncio.ensure_future(self._open.wait())
            try:
                await asyncio.wait({opened}, timeout=0.5)
            finally:
                opened.cancel()

    async def abort(self, request_id: str) -> bool:
        live = self._runs.get(request_id)
        if live is not None:
            live.caller_abort = True
        aborted = await self.inner.abort(request_id)
        return aborted or live is not None

    async def close(self) -> None:
        await self.inner.close()

    # -- updates ----------------------------------------------------------------------------

    async def apply(self, staged: Any, version: str, mode: Mode) -> Applied:
        """Swap in `staged` weights under `mode`; the caller holds `lock`."""
        previous = self.weight_version
        if mode is Mode.KEEP:
            kept = len(self._runs)
            start = time.monotonic()
            await self.inner.freeze()
            try:
                load_s = await self._apply(staged, version)
            finally:
                await self.inner.thaw()
            return self._done(Applied(previous, version, mode, time.monotonic() - start, load_s, kept=kept))
        self._open.clear()
        start = time.monotonic()
        try:
            if mode is Mode.CUT:
                victims = [(rid, live) for rid, live in self._runs.items() if not live.caller_abort]
                for rid, live in victims:
                    live.update_cut = True
                    await self.inner.abort(rid)
                try:
                    await _wait_all([live.parked for _, live in victims])
                except TimeoutError:
                    raise parked_timeout() from None
                cut = [live for _, live in victims if live.was_cut]  # the others finished first
                load_s = await self._apply(staged, version)
            else:
                drained = len(self._runs)
                async with self._ended:
                    await self._ended.wait_for(lambda: not self._runs)
                load_s = await self._apply(staged, version)
        finally:
            self._open.set()
        pause_s = time.monotonic() - start
        if mode is Mode.DRAIN:
            return self._done(Applied(previous, version, mode, pause_s, load_s, drained=drained))
        with contextlib.suppress(TimeoutError):  # applied: whatever happens now, the update is done
            await _wait_all([live.continued for live in cut])
        recomputed = sum(live.recomputed for live in cut)
        return self._done(Applied(previous, version, mode, pause_s, load_s, cut=len(cut), recomputed=recomputed))

    async def _apply(self, staged: Any, version: str) -> float:
        start = time.monotonic()
        await self.inner.apply_weights(staged, version)
        return time.monotonic() - start

    def _done(self, applied: Applied) -> Applied:
        self.updates += 1
        self.updated_at = time.time()
        if not self.history:
            self.history.append(applied.previous)
        self.history.append(applied.version)
        del self.history[:-HISTORY]
        return applied

    def versions(self) -> list[str]:
        """Versions served since start, oldest first, the current one last."""
        return list(self.history) or [self.weight_version]

    async def stage(self, folder: WeightsFolder) -> Any:
        return await self.inner.stage_weights(folder)


async def _wait_all(events: list[asyncio.Event]) -> None:
    if events:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), CONTINUE_WAIT)


def parked_timeout() -> Unavailable:
    return Unavailable(
        f"the running generations did not stop within {CONTINUE_WAIT:g}s; nothing was loaded, retry the update"
    )
