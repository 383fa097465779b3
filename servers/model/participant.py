"""The model participant: held responses, generation cuts, and the capture ledger (docs/design.md §7).

Prepare closes admission: new calls wait for resume; every unary generation still running
is cut (`backend.abort`, keeping the prefix tokens) and parks (one still rendering its prompt
parks before it reaches the backend, whose abort would find nothing); a generation that finishes
while admission is closed has its response held. Neither blocks the prepare: the agent
waiting on such a call is at its boundary before the call. Only streaming responses
already being delivered block, until they end.

Commit captures, per episode, the ledger rows of delivered calls (references: a row is
never changed) plus copies of the cut and held generations; the write makes the records.
On resume a cut generation continues from its prefix and every held response is delivered;
after a crash and restore, the re-issued call (matched by rollout, prompt and sampling)
continues from the prefix instead. Rows move to the next attempt,
so the ledger holds every delivered token exactly once.

`ModelServicer` calls the hooks `admit`, `generate` and `deliver` when `servicer.gate` is
this participant (set by the constructor).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any

from gymrpc.control import Capture, EpisodeKey, Kind, Participant, Report, Scope
from gymrpc.errors import DataLoss, FailedPrecondition
from gymrpc.messages import message_to_dict
from gymrpc.servers.model import spans as version_spans
from gymrpc.servers.model.backends.base import Completion, Conversation, Finish, Sampling
from gymrpc.servers.model.capture import (
    FINISH_OF,
    CaptureLedger,
    CutsView,
    CutView,
    Generation,
    RestoredCuts,
    cuts_of,
    request_digest,
)
from gymrpc.servers.model.flights import Flight
from gymrpc.servers.model.requests import Checked
from gymrpc.servers.model.service import ModelServicer
from gymrpc.v1 import checkpoint_records_pb2 as rec_pb
from gymrpc.v1 import model_service_pb2 as pb

Run = Callable[[Flight, Checked, bool], Coroutine[Any, Any, None]]
Staged = dict[EpisodeKey, tuple[list[rec_pb.CaptureRow], list[rec_pb.GenerationCut]]]
BLOCKING = ("generating", "streaming")


class ModelParticipant(Participant):
    kind = Kind.MODEL

    def __init__(self, servicer: ModelServicer) -> None:
        super().__init__()
        self.servicer = servicer
        self.backend = servicer.backend
        self.ledger = CaptureLedger()
        self.cuts = RestoredCuts()
        self._generations: dict[str, Generation] = {}
        self._pending: set[EpisodeKey] = set()
        """Restored episodes no call has touched yet (freed if a commit scope leaves them out)."""
        servicer.gate = self

    # -- hooks called by ModelServicer -------------------------------------------------------

    def admit(
        self, request: pb.GenerateRequest, checked: Checked, streaming: bool, run: Run
    ) -> Callable[[Flight], Coroutine[Any, Any, None]]:
        """Refuse a retired attempt now; return the flight body, which waits while admission is closed."""
        episode = EpisodeKey(checked.rollout_id, request.episode_id.attempt)
        self.marks.check(episode)
        self._pending.discard(episode)

        async def body(flight: Flight) -> None:
            generation = Generation(checked.request_id, episode, streaming)
            self._generations[checked.request_id] = generation
            try:
                await self.admission.enter(episode, blocks=False)
                generation.state = "streaming" if streaming else "generating"
                await run(flight, checked, streaming)
            finally:
                if self._generations.get(checked.request_id) is generation:
                    del self._generations[checked.request_id]
                self.changed.notify()

        return body

    async def generate(
        self, prompt: Sequence[int], sampling: Sampling, request_id: str, *, conversation: Conversation
    ) -> Completion:
        """A unary generation that a checkpoint can cut and that continues from a restored cut."""
        gen = self._generations[request_id]
        gen.digest = request_digest(gen.episode.rollout_id, prompt, sampling)
        cut = self.cuts.take(gen.episode, gen.digest) if gen.episode.rollout_id else None
        if cut is not None:
            gen.token_ids = list(cut.prefix_token_ids)
            gen.logprobs = list(cut.prefix_logprobs) if cut.prefix_logprobs or not cut.prefix_token_ids else None
            gen.weight_version = cut.weight_version
            version_spans.extend(gen.spans, cut.weight_version, len(gen.token_ids))
            if cut.complete:
                gen.finish = FINISH_OF.get(cut.finish_reason, Finish.STOP)
                return self._completion(gen)
        while True:
            self.marks.check(gen.episode)  # retired while parked, or while it rendered (nothing to abort then)
            # Cut while it rendered: the abort found no request in the backend, so it parks now. Started anyway,
            # it would block the prepare until it finished, forever on an engine that is stopped or stuck.
            finish = Finish.ABORT if gen.cut_requested else await self._stream(gen, prompt, sampling, conversation)
            self.marks.check(gen.episode)  # retired while it generated
            if finish is Finish.ABORT and gen.cut_requested:
                gen.state = "cut"
                self.changed.notify()
                await self.admission.wait_open("the cut generation")
                gen.cut_requested, gen.state = False, "generating"
                continue
            gen.finish = finish or Finish.ABORT
            return self._completion(gen)

    async def _stream(
        self, gen: Generation, prompt: Sequence[int], sampling: Sampling, conversation: Conversation
    ) -> Finish | None:
        """Run the generation in the backend (continuing from its prefix, if any) until it ends or is cut."""
        if gen.token_ids:
            gen.continued_at.append(len(gen.token_ids))
            stream = self.backend.continue_stream(
                prompt, gen.token_ids, sampling, gen.request_id, conversation=conversation
            )
        else:
            stream = self.backend.stream(prompt, sampling, gen.request_id, conversation=conversation)
        finish = None
        async for delta in stream:
            gen.token_ids.extend(delta.token_ids)
            if delta.logprobs is None:
                gen.logprobs = None
            elif gen.logprobs is not None:
                gen.logprobs.extend(delta.logprobs)
            gen.weight_version = delta.weight_version or gen.weight_version
            version_spans.extend(gen.spans, gen.weight_version, len(delta.token_ids))
            finish = delta.finish or finish
        return finish

    @staticmethod
    def _completion(gen: Generation) -> Completion:
        logprobs = None if gen.logprobs is None else tuple(gen.logprobs)
        return Completion(
            tuple(gen.token_ids),
            logprobs,
            gen.finish or Finish.STOP,
            gen.weight_version,
            continued_at=tuple(gen.continued_at),
            spans=tuple(gen.spans),
        )

    async def deliver(self, checked: Checked, response: pb.GenerateResponse) -> None:
        """Hold a unary response while admission is closed; record it in the ledger as it leaves."""
        gen = self._generations.get(checked.request_id)
        if gen is None:
            return
        if not gen.streaming and not self.admission.is_open:
            gen.state = "held"
            self.changed.notify()
            await self.admission.wait_open("the held response")
        self.marks.check(gen.episode)
        if gen.episode.rollout_id:
            self.ledger.record(
                gen.episode,
                rec_pb.CaptureRow(
                    request_id=gen.request_id,
                    source_attempt=gen.episode.attempt,
                    tokens=response.tokens,
                    finish_reason=response.finish_reason,
                    weight_version=response.weight_version,
                    message=response.message,
                    weight_versions=response.weight_versions,
                ),
            )
        gen.state = "delivered"

    # -- admission ---------------------------------------------------------------------------

    async def close_admission(self) -> None:
        await self.servicer.backend.idle()  # a weight update in progress finishes first, never half-applied
        self.admission.close()
        for gen in list(self._generations.values()):
            if gen.state == "generating":
                gen.cut_requested = True
                await self.backend.abort(gen.request_id)

    def readiness(self) -> Report:
        """Only the generations in flight are looked at; the ledger's size is a status count."""
        gens = list(self._generations.values())
        states = [g.state for g in gens]
        return Report(
            blockers=tuple(sorted({g.episode for g in gens if g.state in BLOCKING})),
            counts={
                "held": states.count("held"),
                "cut": states.count("cut"),
                "waiting": states.count("waiting"),
                "restored_cuts": len(self.cuts),
            },
        )

    def status_counts(self) -> dict[str, int]:
        return {"ledger_rows": len(self.ledger)}  # sums over every episode: GetStatus only

    # -- commit ------------------------------------------------------------------------------

    def _parked(self) -> dict[EpisodeKey, list[CutView]]:
        out: dict[EpisodeKey, list[CutView]] = {}
        for gen in self._generations.values():
            if gen.state in ("cut", "held") and gen.episode.rollout_id:
                out.setdefault(gen.episode, []).append(gen.view())
        return out

    async def capture(self, scope: Scope) -> Capture:
        """Copies of the ledger's and the cuts' dicts (their values never change) and the parked
        generations: no work per episode while they are parked; the scope is applied by `records()`."""
        rows = self.ledger.view()
        build = functools.partial(
            _captured_records, scope, rows, self._parked(), self.cuts.view(), self.backend.weight_version
        )
        return Capture(build, len(rows))

    async def delete_restored(self, scope: Scope) -> None:
        if scope is None:
            return
        dropped = [e for e in self._pending if e not in scope]
        self.ledger.drop(dropped)
        self.cuts.drop(dropped)
        self._pending.difference_update(dropped)

    # -- restore -----------------------------------------------------------------------------

    def not_fresh(self) -> str | None:
        if len(self.ledger):
            return f"its ledger already holds {len(self.ledger)} delivered calls"
        return super().not_fresh()  # calls still waiting for admission do not count: they were never run

    def check_records(
        self, records: Sequence[rec_pb.CheckpointRecord], *, allow_weight_version_mismatch: bool = False
    ) -> None:
        """A checkpoint taken under other weights continues its episodes with a policy they never saw."""
        loaded = self.backend.weight_version
        for record in records:
            if record.WhichOneof("body") != "model_episode":
                continue
            theirs = record.model_episode.loaded_weight_version
            if theirs and theirs != loaded and not allow_weight_version_mismatch:
                raise FailedPrecondition(
                    f"the checkpoint was taken with weights {theirs!r} loaded, but this model server has "
                    f"{loaded!r}; load {theirs!r} first (UpdateWeights), or restore with "
                    "allow_weight_version_mismatch to continue its episodes under the new weights",
                    reason="WEIGHT_VERSION_MISMATCH",
                    metadata={"checkpoint_weight_version": theirs, "loaded_weight_version": loaded},
                )

    async def stage(self, records: Sequence[rec_pb.CheckpointRecord], scope: frozenset[EpisodeKey]) -> Staged:
        staged: Staged = {}
        for record in records:
            episode = EpisodeKey.of(record.episode_id)
            if record.WhichOneof("body") != "model_episode":
                raise DataLoss(f"the record of {episode} is not a model episode; nothing was installed")
            body = record.model_episode
            for row in body.rows:
                trace = row.tokens
                if trace.completion_logprobs and len(trace.completion_logprobs) != len(trace.completion_token_ids):
                    raise DataLoss(f"a ledger row of {episode} has mismatched tokens and logprobs")
            for cut in body.cuts:
                if len(cut.request_digest) != 64 or (
                    cut.prefix_logprobs and len(cut.prefix_logprobs) != len(cut.prefix_token_ids)
                ):
                    raise DataLoss(f"a generation cut of {episode} is malformed; nothing was installed")
            _merge(staged.setdefault(episode.next(), ([], [])), body)
        for episode in scope:
            staged.setdefault(episode.next(), ([], []))
        return staged

    async def install(self, staged: Staged) -> list[EpisodeKey]:
        memory = self.servicer.memory
        self._pending.update(staged)
        for episode, (rows, cuts) in staged.items():
            self.ledger.install(episode, rows)
            self.cuts.install(episode, cuts)
            for row in rows:  # the next turn's prompt re-renders these replies exactly as generated
                memory.remember(
                    row.tokens.prompt_token_ids, message_to_dict(row.message), row.tokens.completion_token_ids
                )
        return sorted(staged)

    # -- retire ------------------------------------------------------------------------------

    async def retire(self, episodes: Sequence[EpisodeKey]) -> None:
        doomed = [g for g in self._generations.values() if self.marks.is_retired(g.episode)]
        for gen in doomed:
            gen.cut_requested = False
            await self.backend.abort(gen.request_id)
        while any(g.request_id in self._generations and g.state in BLOCKING for g in doomed):
            await self.changed.wait(1.0)
        self.ledger.drop([e for e in self.ledger.episodes() if self.marks.is_retired(e)])
        self.cuts.drop(episodes)
        self._pending = {e for e in self._pending if not self.marks.is_retired(e)}
        replay = getattr(self.servicer, "replay", None)  # the OpenAI front door's record (gymrpc.servers.model.replay)
        if replay is not None:
            replay.retired(self.marks.is_retired)

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        replay = getattr(self.servicer, "replay", None)
        if replay is not None:
            replay.forget(rollout_ids)

    def details(self) -> dict[str, str]:
        return {
            "backend": self.backend.name,
            "ledger_tokens": str(self.ledger.tokens()),
            **self.backend.status_details(),
            "weight_version": self.backend.weight_version,
        }


def _captured_records(
    scope: Scope,
    rows: Mapping[EpisodeKey, Sequence[rec_pb.CaptureRow]],
    parked: Mapping[EpisodeKey, Sequence[CutView]],
    cuts: CutsView,
    weight_version: str,
) -> Iterator[rec_pb.CheckpointRecord]:
    """A capture's records (worker thread): the episodes of `scope` (None: every one it knows), from the views."""
    episodes = scope
    if episodes is None:
        episodes = frozenset({*parked, *rows, *(EpisodeKey(r, a) for (r, _), (a, _) in cuts.items())})
    yield from _records(episodes, rows, parked, cuts_of(cuts, episodes), weight_version)


def _records(
    episodes: Collection[EpisodeKey],
    rows: Mapping[EpisodeKey, Sequence[rec_pb.CaptureRow]],
    parked: Mapping[EpisodeKey, Sequence[CutView]],
    restored: Mapping[EpisodeKey, Sequence[rec_pb.GenerationCut]],
    weight_version: str,
) -> Iterator[rec_pb.CheckpointRecord]:
    """A capture's records (worker thread): one per episode, its rows, then its parked and restored cuts."""
    for episode in sorted(e for e in episodes if e.rollout_id):
        body = rec_pb.ModelEpisodeRecord(
            rows=rows.get(episode, ()),
            cuts=[*(v.to_pb() for v in parked.get(episode, ())), *restored.get(episode, ())],
            loaded_weight_version=weight_version,
        )
        yield rec_pb.CheckpointRecord(episode_id=episode.to_pb(), model_episode=body)


def _merge(into: tuple[list[rec_pb.CaptureRow], list[rec_pb.GenerationCut]], body: rec_pb.ModelEpisodeRecord) -> None:
    """Add one record's rows and cuts to an episode's, each once.

    A restore that reads every model replica's records sees an episode once per replica that
    knew it (each exports one record per episode of the commit scope, most of them empty, and
    an episode whose calls failed over has rows on both): rows merge by request id, cuts by
    digest and request id, in the order the records were read.
    """
    rows, cuts = into
    seen = {r.request_id for r in rows}
    rows.extend(r for r in body.rows if r.request_id not in seen)
    known = {(c.request_digest, c.source_request_id) for c in cuts}
    cuts.extend(c for c in body.cuts if (c.request_digest, c.source_request_id) not in known)
