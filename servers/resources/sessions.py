"""Sessions of one environment: ownership, episode binding, ordering and idempotency.

Environment code is synchronous and may be slow (pandas), so it runs in a thread
pool; calls of one session are serialised by a per-session lock, calls of different
sessions run in parallel.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gymrpc.envkit import (
    Environment,
    InvalidTask,
    Session,
    SnapshotCorrupt,
    SnapshotFormat,
    SnapshotUnsupported,
    StepResult,
    TaskSpec,
    ToolError,
    ToolResult,
    VerifyResult,
)
from gymrpc.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from gymrpc.servers.resources.frozen import FrozenSessions

T = TypeVar("T")
MAX_CLOSED_REMEMBERED = 100_000
MAX_RESULTS_PER_SESSION = 10_000
SEED = "seed"
"""`Slot.last_change` of a session nothing has changed since its seed (call keys have a colon)."""


def not_owner(session_id: str) -> PermissionDenied:
    """A call for a session another episode owns; the owner is not named (it is that episode's business)."""
    return PermissionDenied(
        f"session {session_id!r} belongs to another episode; only the episode that seeded it may use it",
        reason="NOT_SESSION_OWNER",
        metadata={"session_id": session_id},
    )


def request_digest(*parts: str) -> bytes:
    """What a call asked (a tool's name and arguments text, a turn's text): a retry asks the same,
    another call that reuses the id does not (lengths prefixed, so no two splits hash alike)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


@dataclass(frozen=True, slots=True)
class Reply:
    """A call's first reply, kept for its retries, with the digest of what the call asked."""

    result: ToolResult | StepResult
    digest: bytes = b""
    """`request_digest` of the call; b"" when not known (a record written before it was kept)."""


@dataclass(frozen=True)
class EpisodeKey:
    rollout_id: str
    attempt: int


@dataclass
class Slot:
    """One live session with what the host keeps beside it."""

    session: Session
    episode: EpisodeKey
    seed_fingerprint: str
    seed_reply: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    results: OrderedDict[str, Reply] = field(default_factory=OrderedDict)
    """Replies by de-duplication key (`call:<id>`, `turn:<id>`): a retry returns the first reply."""
    verify_failed: bool = False
    """The last `verify` raised: the episode failed, so coordinated checkpoints leave the session out."""
    last_change: str = ""
    """De-duplication key of the call that last changed the session (`seed` after seeding, "" once a
    verify ran): a retry of that call may still export the state right after it (`after`)."""
    unrepeated: set[str] | None = None
    """In a replay (the seed retried after the session changed: a retried run), the keys of the
    earlier run's calls this run has not asked again; None outside a replay."""


class SessionHost:
    """Owns every session of one environment instance."""

    def __init__(self, environment: Environment, *, workers: int = 8) -> None:
        self.environment = environment
        self._slots: dict[str, Slot] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"env-{environment.name}")
        self.frozen = FrozenSessions()
        self.session_types: set[type[Session]] = set()
        """Every class of session this host ever held (a capture checks them all at once, not each session)."""
        """Open copy-on-write captures: told before any session changes (`_changing`)."""

    def __len__(self) -> int:
        return len(self._slots)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.environment.runs_inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- lookup --------------------------------------------------------------------------

    def slot(self, session_id: str, episode: EpisodeKey) -> Slot:
        """The live session bound to `episode`; a clear error for every way that can fail."""
        slot = self._slots.get(session_id)
        if slot is None:
            if session_id in self._closed:
                raise FailedPrecondition(
                    f"session {session_id!r} is closed",
                    reason="SESSION_CLOSED",
                    metadata={"session_id": session_id},
                )
            raise NotFound(
                f"session {session_id!r} does not exist on this server (seed it first)",
                metadata={"session_id": session_id},
            )
        if slot.episode != episode:
            if slot.episode.rollout_id == episode.rollout_id and episode.attempt < slot.episode.attempt:
                raise FailedPrecondition(
                    f"attempt {episode.attempt} of {episode.rollout_id!r} is stale: the session belongs to "
                    f"attempt {slot.episode.attempt}",
                    reason="STALE_ATTEMPT",
                    metadata={"rollout_id": episode.rollout_id, "attempt": str(episode.attempt)},
                )
            if slot.episode.rollout_id != episode.rollout_id:
                raise not_owner(session_id)
            raise FailedPrecondition(
                f"session {session_id!r} belongs to attempt {slot.episode.attempt} of its episode, "
                f"not {episode.attempt}",
                metadata={"session_id": session_id},
            )
        return slot

    # -- lifecycle -----------------------------------------------------------------------

    async def seed(
        self,
        session_id: str,
        episode: EpisodeKey,
        task: TaskSpec,
        fingerprint: str,
        reply: Callable[[Sequence[str]], Any],
    ) -> Any:
        existing = self._slots.get(session_id)
        if existing is not None:
            if existing.seed_fingerprint == fingerprint and existing.episode == episode:
                if existing.last_change != SEED:  # a retried run: it must repeat what changed the session
                    existing.unrepeated = set(existing.results)
                return existing.seed_reply
            raise AlreadyExists(
                f"session {session_id!r} was already seeded with another task or episode",
                metadata={"session_id": session_id},
            )
        try:
            session, observations = await self.run(self.environment.seed, task)
        except InvalidTask as exc:
            raise InvalidArgument(
                f"task rejected by {self.environment.name}: {exc}",
                metadata={"environment": self.environment.name},
            ) from None
        if session_id in self._slots:  # a concurrent seed of the same id won the race
            await self.run(session.close)
            return await self.seed(session_id, episode, task, fingerprint, reply)
        slot = Slot(session, episode, fingerprint, reply(observations), last_change=SEED)
        self.session_types.add(type(session))
        self._slots[session_id] = slot
        self._closed.pop(session_id, None)
        return slot.seed_reply

    async def close(self, session_id: str, episode: EpisodeKey) -> bool:
        if session_id not in self._slots:
            return False
        slot = self.slot(session_id, episode)
        async with slot.lock:
            if self._slots.get(session_id) is not slot:
                return False
            self._changing(session_id, slot)
            del self._slots[session_id]
            self._remember_closed(session_id)
        await self.run(slot.session.close)
        return True

    def _remember_closed(self, session_id: str) -> None:
        self._closed[session_id] = None
        while len(self._closed) > MAX_CLOSED_REMEMBERED:
            self._closed.popitem(last=False)

    # -- episode calls -------------------------------------------------------------------

    async def call_tool(
        self,
        session_id: str,
        episode: EpisodeKey,
        call_id: str,
        name: str,
        arguments: Mapping[str, Any] | None,
        bad_arguments: str | None,
        *,
        digest: bytes = b"",
        export: bool = False,
    ) -> tuple[ToolResult, bytes | None]:
        """The call's result (a retry with the same `call_id` gets the first one) and, if `export`, the
        session's snapshot payload right after the call (`after`). `digest` is the call's
        `request_digest`: another call under a known id is refused, not answered with a stale result."""
        if export:
            self.require_snapshots()  # refused before the call runs: nothing changes
        slot = self.slot(session_id, episode)
        async with slot.lock:
            key = f"call:{call_id}"
            known = slot.results.get(key) if call_id else None
            if known is not None:
                _check_retry(slot, key, known, digest, session_id, "another tool name or arguments")
                result = known.result
            else:
                _check_replay(slot, session_id, key)
                self._changing(session_id, slot)
                slot.last_change = key  # from here on the session may differ from before this call
                if bad_arguments is not None:
                    result = ToolResult(bad_arguments, is_error=True)
                else:
                    try:
                        result = await self.run(slot.session.call_tool, name, arguments or {})
                    except ToolError as exc:
                        result = ToolResult(str(exc), is_error=True)
                self._remember(slot, key, Reply(result, digest))
            return result, await self.after(slot, key) if export else None

    async def step(
        self, session_id: str, episode: EpisodeKey, turn_id: str, text: str, *, export: bool = False
    ) -> tuple[StepResult, bytes | None]:
        """The turn's result (a retry with the same `turn_id` gets the first one) and, if `export`, the
        session's snapshot payload right after the turn (`after`)."""
        if export:
            self.require_snapshots()
        slot = self.slot(session_id, episode)
        async with slot.lock:
            key = f"turn:{turn_id}"
            digest = request_digest(text)
            known = slot.results.get(key) if turn_id else None
            if known is not None:
                _check_retry(slot, key, known, digest, session_id, "other text")
                result = known.result
            else:
                _check_replay(slot, session_id, key)
                self._changing(session_id, slot)
                slot.last_change = key  # from here on the session may differ from before this turn
                try:
                    result = await self.run(slot.session.step, text)
                except ToolError as exc:
                    raise FailedPrecondition(str(exc)) from None
                self._remember(slot, key, Reply(result, digest))
            return result, await self.after(slot, key) if export else None

    async def after(self, slot: Slot, key: str) -> bytes:
        """The session's snapshot payload right after the call `key` (hold `slot.lock`).

        Exact: the call ran last on the session, so its state now is the state after it. A retry of
        an older call (the session changed since) is refused rather than answered with a later state.
        """
        if slot.last_change != key:
            what = "its seed" if key == SEED else f"{key.partition(':')[0]} {key.partition(':')[2]!r}"
            raise FailedPrecondition(
                f"the session changed after {what}, so its state right after it is gone (a retry of an older "
                "call); call CheckpointSession for the current state",
                metadata={"call": key[:140]},
            )
        try:
            return await self.run(slot.session.export)
        except SnapshotUnsupported as exc:
            raise FailedPrecondition(str(exc), reason="SNAPSHOT_UNSUPPORTED") from None

    async def export_after_seed(self, session_id: str, episode: EpisodeKey) -> bytes:
        """The session's snapshot payload right after its seed (`after`): the seed's reply carries it."""
        slot = self.slot(session_id, episode)
        async with slot.lock:
            return await self.after(slot, SEED)

    async def verify(self, session_id: str, episode: EpisodeKey, messages: Sequence[Mapping[str, Any]]) -> VerifyResult:
        slot = self.slot(session_id, episode)
        async with slot.lock:
            _check_replay(slot, session_id, "verify")
            self._changing(session_id, slot)
            slot.last_change = ""  # an environment's verify may change the session
            try:
                result = await self.run(slot.session.verify, messages)
            except Exception:  # not a cancelled call: the verify itself may still finish
                slot.verify_failed = True
                raise
            slot.verify_failed = False
            return result

    def _changing(self, session_id: str, slot: Slot) -> None:
        """Every path that changes a live session (its state, replies or flags) calls this first."""
        self.frozen.before_change(session_id, slot)

    @staticmethod
    def _remember(slot: Slot, key: str, reply: Reply) -> None:
        if not key.endswith(":"):
            slot.results[key] = reply
            while len(slot.results) > MAX_RESULTS_PER_SESSION:
                slot.results.popitem(last=False)

    # -- snapshots -----------------------------------------------------------------------

    def require_snapshots(self) -> SnapshotFormat:
        """The environment's snapshot format, or FAILED_PRECONDITION when it cannot snapshot sessions."""
        fmt = self.environment.snapshot_format
        if fmt is None:
            raise FailedPrecondition(
                f"environment {self.environment.name!r} cannot snapshot sessions",
                reason="SNAPSHOT_UNSUPPORTED",
                metadata={"environment": self.environment.name},
            )
        return fmt

    async def export(self, session_id: str, episode: EpisodeKey) -> bytes:
        self.require_snapshots()
        slot = self.slot(session_id, episode)
        async with slot.lock:
            try:
                return await self.run(slot.session.export)
            except SnapshotUnsupported as exc:
                raise FailedPrecondition(str(exc), reason="SNAPSHOT_UNSUPPORTED") from None

    async def restore(self, session_id: str, episode: EpisodeKey, payload: bytes, reply: Any) -> None:
        """Decode first, then swap in: a corrupt payload leaves the live session untouched."""
        self.require_snapshots()
        try:
            session = await self.run(self.environment.restore, payload)
        except SnapshotCorrupt as exc:
            raise DataLoss(
                f"snapshot for session {session_id!r} does not decode: {exc}",
                metadata={"session_id": session_id},
            ) from None
        digest = "sha256:" + hashlib.sha256(payload).hexdigest()
        old = self._slots.get(session_id)
        if old is not None and old.episode.rollout_id != episode.rollout_id:
            with contextlib.suppress(Exception):
                await self.run(session.close)
            raise not_owner(session_id)
        if old is not None:
            self._changing(session_id, old)
        self.session_types.add(type(session))
        self._slots[session_id] = Slot(session, episode, f"restored:{digest}", reply)
        self._closed.pop(session_id, None)
        if old is not None:
            async with old.lock:
                await self.run(old.session.close)

    async def discard(self, session_id: str, episode: EpisodeKey) -> bool:
        return await self.close(session_id, episode)

    # -- coordinated checkpoints (gymrpc.servers.resources.participant) ---------------------------

    def live(self) -> dict[str, Slot]:
        """Live sessions by id: a copy, safe to iterate while calls run."""
        return dict(self._slots)

    @property
    def served(self) -> bool:
        """True once any session was seeded or restored here (the process is no longer fresh)."""
        return bool(self._slots or self._closed)

    def install(self, slots: Mapping[str, Slot]) -> None:
        """Add sessions decoded beforehand, all at once (nothing is added if any id is live)."""
        clash = sorted(set(slots) & set(self._slots))
        if clash:
            raise AlreadyExists(f"sessions {clash[:5]} are already live; nothing was installed")
        self._slots.update(slots)
        self.session_types.update(type(slot.session) for slot in slots.values())
        for session_id in slots:
            self._closed.pop(session_id, None)


def _check_retry(slot: Slot, key: str, known: Reply, digest: bytes, session_id: str, other: str) -> None:
    """A known key's first reply goes to a retry of its call only: another call under it is refused
    (`REQUEST_ID_REUSED`; in a replay `REPLAY_DIVERGENCE`: the retried run went another way)."""
    kind, _, ident = key.partition(":")
    what = "tool call id" if kind == "call" else "turn_id"
    if known.digest and digest and known.digest != digest:
        metadata = {"session_id": session_id, "id": ident[:140]}
        if slot.unrepeated is not None:
            raise FailedPrecondition(
                f"a retried run of session {session_id!r} sent {what} {ident[:140]!r} with {other} than the "
                "earlier run: the agent or its model's replies are not deterministic; nothing was run "
                "(DiscardSession starts the episode over)",
                reason="REPLAY_DIVERGENCE",
                metadata=metadata,
            )
        raise AlreadyExists(
            f"{what} {ident[:140]!r} of session {session_id!r} was already used by a call with {other}; a retry "
            "must resend the same call, a new call needs a new id (its first result is not the answer to this "
            "one); nothing was run",
            reason="REQUEST_ID_REUSED",
            metadata=metadata,
        )
    if slot.unrepeated:
        slot.unrepeated.discard(key)


def _check_replay(slot: Slot, session_id: str, key: str) -> None:
    """In a replay, a call the earlier run did not make (or a verify) is refused until every keyed call
    it made is repeated: the session holds their effects, which this run has not seen."""
    if not slot.unrepeated:
        return
    kind, _, ident = key.partition(":")
    asked = {"call": f"tool call {ident[:140]!r}", "turn": f"turn {ident[:140]!r}"}.get(kind)
    asked = f"asked {asked}, which the earlier run did not," if asked else "asked for its reward"
    examples = ", ".join(sorted(k.partition(":")[2][:40] for k in slot.unrepeated)[:3])
    raise FailedPrecondition(
        f"a retried run of session {session_id!r} {asked} while {len(slot.unrepeated)} of the earlier run's "
        f"calls are not repeated yet (ids {examples}): the session holds their effects, so the agent or its "
        "model's replies are not deterministic; nothing was run (DiscardSession starts the episode over)",
        reason="REPLAY_DIVERGENCE",
        metadata={"session_id": session_id, "id": ident[:140], "unrepeated": str(len(slot.unrepeated))},
    )
