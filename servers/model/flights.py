"""Idempotency for model calls: one generation per `request_id`, shared by every retry.

A `Flight` is one generation running in its own task, so a client that
disconnects or times out does not lose it: the retry (same `request_id`, same
content) attaches to the running flight or gets the finished response, streamed
deltas included. The same `request_id` with different content is a conflict
(ALREADY_EXISTS). A failed flight is dropped so that a retry generates afresh.
Finished flights are kept in a bounded LRU; running ones are never evicted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from gymrpc.errors import AlreadyExists, Unavailable
from gymrpc.v1 import model_service_pb2 as pb


class Flight:
    def __init__(self, request_id: str, fingerprint: str) -> None:
        self.request_id = request_id
        self.fingerprint = fingerprint
        self.deltas: list[pb.TokenDelta] = []
        self.final: asyncio.Future[pb.GenerateResponse] = asyncio.get_running_loop().create_future()
        # Retrieve a failure even when nobody waits for it, so asyncio does not log it as lost.
        self.final.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._changed = asyncio.Event()

    def publish(self, delta: pb.TokenDelta) -> None:
        self.deltas.append(delta)
        self._wake()

    def finish(self, response: pb.GenerateResponse) -> None:
        if not self.final.done():
            self.final.set_result(response)
        if len(self.deltas) > 1:
            # Kept for retries: one merged delta instead of one per token. Subscribers still
            # streaming hold the old list, so they miss nothing.
            merged = pb.TokenDelta()
            for delta in self.deltas:
                merged.text += delta.text
                merged.token_ids.extend(delta.token_ids)
                merged.logprobs.extend(delta.logprobs)
            self.deltas = [merged]
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self.final.done():
            self.final.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def events(self) -> AsyncIterator[pb.TokenDelta]:
        """Every delta from the first, then return once the flight is over (the caller awaits `result`)."""
        sent, deltas = 0, self.deltas
        while True:
            changed = self._changed
            while sent < len(deltas):
                yield deltas[sent]
                sent += 1
            if self.final.done():
                return
            await changed.wait()

    async def result(self) -> pb.GenerateResponse:
        # Shielded: a caller that goes away must not cancel the generation its retry will want.
        return await asyncio.shield(self.final)


class FlightTable:
    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._flights: OrderedDict[str, Flight] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(
        self, request_id: str, fingerprint: str, run: Callable[[Flight], Coroutine[Any, Any, None]]
    ) -> tuple[Flight, bool]:
        """The flight for `request_id` (started with `run` if new) and whether it was new."""
        flight = self._flights.get(request_id)
        if flight is not None:
            if flight.fingerprint != fingerprint:
                raise AlreadyExists(
                    f"request_id {request_id!r} was already used for a different request; "
                    "a retry must resend the same request, a new call needs a new request_id",
                    reason="REQUEST_ID_REUSED",
                    metadata={"request_id": request_id[:200]},
                )
            self._flights.move_to_end(request_id)
            return flight, False
        flight = Flight(request_id, fingerprint)
        self._flights[request_id] = flight
        task = asyncio.get_running_loop().create_task(self._run(flight, run), name=f"generate:{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._evict()
        return flight, True

    async def _run(self, flight: Flight, run: Callable[[Flight], Coroutine[Any, Any, None]]) -> None:
        try:
            await run(flight)
            if not flight.final.done():
                raise RuntimeError(f"generation {flight.request_id!r} ended without a response")
        except BaseException as exc:
            if self._flights.get(flight.request_id) is flight:
                del self._flights[flight.request_id]
            flight.fail(
                exc if isinstance(exc, Exception) else Unavailable("the model server is stopping; retry the call")
            )
            if not isinstance(exc, Exception):
                raise

    def _evict(self) -> None:
        excess = len(self._flights) - self.capacity
        if excess <= 0:
            return
        # Oldest first, and the oldest are nearly always done: a full table evicts after a step or two,
        # not a scan of every flight on each admit.
        done = (rid for rid, f in self._flights.items() if f.final.done())
        for request_id in list(itertools.islice(done, excess)):
            del self._flights[request_id]

    def __len__(self) -> int:
        return len(self._flights)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
