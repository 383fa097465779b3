"""From finished episodes to what a policy-gradient step needs: token ids, a loss mask, old logprobs, advantages.

No torch here, so the arithmetic is tested in the fast tier. An episode's model calls are one
sequence when each call's prompt extends the previous call's prompt + completion (the model
server's template is prefix-stable, so that is the normal case); otherwise each break starts
a new sequence. Only generated tokens are trained: prompts, tool results and the template's
own tokens are masked out. The behaviour logprob of each generated token is the one the
model server sampled it with, so the loss can weigh it by the ratio of new to old probability
(the sampler's weights may be a version behind the trainer's).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gymrpc.v1 import agent_service_pb2 as agent_pb


@dataclass(frozen=True)
class TokenSequence:
    """One token sequence: `trained[i]` marks a generated token, `old_logprobs[i]` its sampling logprob."""

    token_ids: tuple[int, ...]
    trained: tuple[bool, ...]
    old_logprobs: tuple[float, ...]
    """NaN where the token is not trained or the server reported no logprob (then the ratio is 1)."""

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


@dataclass(frozen=True)
class Sample:
    """One episode as training data: its group, its reward, its sequences, its advantage (set later)."""

    episode_id: str
    group: str
    reward: float
    sequences: tuple[TokenSequence, ...]
    versions: tuple[str, ...] = ()
    """The weight versions that produced its tokens, in order (every span of every model call)."""
    advantage: float = 0.0

    @property
    def trained_tokens(self) -> int:
        return sum(s.trained_tokens for s in self.sequences)


class BadTrajectory(ValueError):
    """A trajectory whose token record cannot be trained on (the message says why)."""


def sequences_of(trajectory: agent_pb.Trajectory) -> tuple[TokenSequence, ...]:
    """The model calls of `trajectory` as few sequences as the prefix property allows."""
    out: list[TokenSequence] = []
    ids: list[int] = []
    trained: list[bool] = []
    old: list[float] = []
    for call in trajectory.model_calls:
        prompt, completion = list(call.tokens.prompt_token_ids), list(call.tokens.completion_token_ids)
        logprobs = list(call.tokens.completion_logprobs)
        if logprobs and len(logprobs) != len(completion):
            raise BadTrajectory(
                f"model call {call.step}: {len(logprobs)} logprobs for {len(completion)} completion tokens"
            )
        if not prompt:
            raise BadTrajectory(f"model call {call.step} has no prompt token ids")
        if ids and prompt[: len(ids)] != ids:  # not an extension: close the current sequence
            out.append(TokenSequence(tuple(ids), tuple(trained), tuple(old)))
            ids, trained, old = [], [], []
        tail = prompt[len(ids) :]
        ids += tail + completion
        trained += [False] * len(tail) + [True] * len(completion)
        old += [math.nan] * len(tail) + (logprobs or [math.nan] * len(completion))
    if ids:
        out.append(TokenSequence(tuple(ids), tuple(trained), tuple(old)))
    return tuple(out)


def sample_of(episode_id: str, group: str, trajectory: agent_pb.Trajectory) -> Sample:
    return Sample(episode_id, group, float(trajectory.reward), sequences_of(trajectory), versions_of(trajectory))


def versions_of(trajectory: agent_pb.Trajectory) -> tuple[str, ...]:
    """The weight versions that produced the trajectory's tokens, in order (every span of every model call)."""
    return tuple(
        v for c in trajectory.model_calls for v in [s.weight_version for s in c.weight_versions] or [c.weight_version]
    )


def group_advantages(rewards: Sequence[float], *, scale: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO's advantage: each reward minus its group's mean, divided by the group's std (`scale`).

    A group whose rewards are all equal gives zeros: it says nothing about which sample was better.
    The std is the population std (over the group as it is), as in the GRPO paper's code.
    """
    if not rewards:
        return []
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = statistics.pstdev(rewards)
    if std < eps:
        return [0.0] * len(rewards)
    return [c / (std + eps) for c in centred]


def with_advantages(samples: Iterable[Sample], *, scale: bool = True) -> list[Sample]:
    """Every sample with its group-normalised advantage, in the order given."""
    samples = list(samples)
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample.group, []).append(i)
    out = list(samples)
    for members in groups.values():
        advantages = group_advantages([samples[i].reward for i in members], scale=scale)
        for i, advantage in zip(members, advantages, strict=True):
            s = samples[i]
            out[i] = Sample(s.episode_id, s.group, s.reward, s.sequences, s.versions, advantage)
    return out
