"""`PackedScope`: a commit scope read from the packed form, checked at once, made a set only when used.

A non-stop commit's scope names every episode in flight (5,000 in the bench) while they are
parked. Checking its ids is one regex pass (`types.packed_episode_keys`), but making it a set
of `EpisodeKey`s costs each participant about 2 ms more at 5,000 episodes, and a participant
whose capture takes its state whole (`Participant.capture`) only needs the set when it builds
its records, in the write's worker thread after the resume. So the set is built on first use:
a membership test, iteration, length or comparison. The ids are checked before this exists,
so bad input is refused in the Commit RPC, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import repeat
from typing import Any

from gymrpc.control.types import EpisodeKey


class PackedScope(AbstractSet[EpisodeKey]):
    """The episodes of a packed scope (entry i of each list names one); a `frozenset` once first used."""

    __slots__ = ("_attempts", "_keys", "_rollout_ids")

    def __init__(self, rollout_ids: Sequence[str], attempts: Sequence[int]) -> None:
        self._rollout_ids, self._attempts = rollout_ids, attempts
        self._keys: frozenset[EpisodeKey] | None = None

    @property
    def keys(self) -> frozenset[EpisodeKey]:
        """The set (built once; a worker thread may race the event loop to it: both build the same)."""
        keys = self._keys
        if keys is None:
            keys = self._keys = frozenset(
                map(tuple.__new__, repeat(EpisodeKey), zip(self._rollout_ids, self._attempts, strict=True))
            )
        return keys

    @property
    def built(self) -> bool:
        """Whether the set was made (for tests: the pause should not make it)."""
        return self._keys is not None

    def __contains__(self, item: object) -> bool:
        return item in self.keys

    def __iter__(self) -> Iterator[EpisodeKey]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __bool__(self) -> bool:
        return bool(self._rollout_ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedScope):
            return self.keys == other.keys
        return self.keys == other if isinstance(other, AbstractSet) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.keys)

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> frozenset[Any]:  # type: ignore[override]
        return frozenset(it)  # `&`, `|`, `-` give plain sets

    def __repr__(self) -> str:
        return f"PackedScope({len(self._rollout_ids)} episodes)"
