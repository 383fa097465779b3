"""The reference trainer's start policy: deliberately weak, seeded, and quick to build.

GRPO only learns from groups whose rewards differ, so a start that never succeeds teaches
nothing and one that always does has nothing to learn. The start here is the tiny model
fine-tuned on a *mixture* of counter episodes: the scripted solver's, and near misses in which
it reads a number of the task one too high (`add 4` becomes an increment by 5). Each number
is read right with probability `correct` (independently), so a sampled episode (temperature 1)
ends on the expected count with probability about `correct ** 2`: 0.16 at the default 0.4.
Everything else (the tool-call format, reading the counter, the final answer) is learned
exactly, so what GRPO has to find is the one right number at two places per task.

    python -m gymrpc.train init OUT_DIR        # ~0.5-1 min on a CPU

torch and transformers are imported inside the functions: they are in `.venv-vllm` only.
"""

from __future__ import annotations

import itertools
import json
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from gymrpc.testing.tiny_model import Example, TrainResult, build_tiny_model, train_scripted

_NUMBER = re.compile(r"-?\d+")
START_INFO = "weak_start.json"
"""Written into the model folder: how the start was made, so a run can say what it started from."""


class Misreader:
    """The counter solver, reading the k-th number of the first user message as `n + offsets[k]`."""

    def __init__(self, offsets: Sequence[int]) -> None:
        from servers.model.backends.sources import CounterSolver

        self.offsets = tuple(offsets)
        self._solver = CounterSolver()

    def misread(self, text: str) -> str:
        numbers = iter(self.offsets)
        return _NUMBER.sub(lambda m: str(int(m.group()) + next(numbers, 0)), text)

    def reply(self, conversation: Any) -> str | None:
        from servers.model.backends.base import Conversation

        messages, seen = [], False
        for message in conversation.messages:
            if not seen and message.get("role") == "user":
                message, seen = {**message, "content": self.misread(message.get("content") or "")}, True
            messages.append(message)
        return self._solver.reply(Conversation(messages, conversation.tools, conversation.rollout_id))

    def describe(self) -> str:
        return f"counter solver misreading by {self.offsets}"


def mixture(rows: Sequence[Mapping[str, Any]], correct: float) -> list[Example]:
    """Every task's episodes with each number right or one too high, repeated in proportion.

    `correct` is rounded to a fraction with a denominator of at most 10, so the proportions are
    whole repeats: at 2/5 a two-number task gives 4 right episodes to 6 + 6 + 9 near misses.
    """
    from gymrpc.testing.scripted import counter_examples

    if not 0.0 < correct < 1.0:
        raise ValueError(f"correct must be between 0 and 1 (exclusive), got {correct}")
    odds = Fraction(correct).limit_denominator(10)
    right, wrong = odds.numerator, odds.denominator - odds.numerator
    examples: list[Example] = []
    for row in rows:
        count = len(_NUMBER.findall(_first_user_text(row)))
        for misses in itertools.product((0, 1), repeat=count):
            [example] = counter_examples([row], solver=Misreader(misses))
            examples += [example] * (right ** (count - sum(misses)) * wrong ** sum(misses))
    return examples


def _first_user_text(row: Mapping[str, Any]) -> str:
    items = row["responses_create_params"]["input"]
    return next(m["content"] for m in items if m.get("role") == "user")


@dataclass(frozen=True)
class WeakStart:
    """How the start policy is made; the defaults are what `tests/vllm/test_trainer.py` measures."""

    correct: float = 0.4
    steps: int = 400
    lr: float = 3e-3
    batch_size: int = 16
    seed: int = 0


def build_weak_start(
    out: Path, rows: Sequence[Mapping[str, Any]] | None = None, recipe: WeakStart = WeakStart()
) -> TrainResult:
    """A fresh random tiny model trained for `recipe.steps` on `mixture(rows)`, saved to `out`."""
    from gymrpc.testing.scripted import counter_rows

    rows = counter_rows() if rows is None else rows
    examples = mixture(rows, recipe.correct)
    with tempfile.TemporaryDirectory(prefix="tiny-base-") as tmp:
        build_tiny_model(Path(tmp), seed=recipe.seed)
        # min_prob 0 and one check at the end: exactly `steps` steps (the mixture has no argmax to reach).
        result = train_scripted(
            Path(tmp),
            out,
            examples,
            max_steps=recipe.steps,
            check_every=recipe.steps,
            min_prob=0.0,
            lr=recipe.lr,
            batch_size=recipe.batch_size,
            seed=recipe.seed,
        )
    info = {"recipe": recipe.__dict__, "tasks": len(rows), "steps": result.steps, "loss": result.loss}
    (out / START_INFO).write_text(json.dumps(info, indent=1) + "\n")
    return result
