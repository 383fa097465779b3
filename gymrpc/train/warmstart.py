"""The reference trainer's start policy: deliberately weak, seeded, and quick to build.

GRPO only learns from groups whose rewards differ, so a start that never succeeds teaches
nothing and one that always does has nothing to learn. The start here is the tiny model
fine-tuned on a *mixture* of counter episodes: the scripted solver's, and near misses in which
it reads a number of the task one too high (`add 4` becomes an increment by 5). Each number
is read right with probability `correct` (independently), so a sampled episode (temperature 1)
ends on the expected count with probability about `correct ** 2`: 0.16 at the default 0.4.
Everything else (the tool-call format, reading the counter, the final answer) is learned
exactly, so what GRPO has to find is the one right number at two places per task.

    gymrpc train init OUT_DIR        # about 40 s on a CPU

torch and transformers are imported inside the functions: they are in `.venv-vllm` only.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.testing.tiny_model import Example, build_tiny_model, save_tokenizer

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d+")
TASKS_FILE = "tasks.jsonl"
START_INFO = "weak_start.json"
"""Written into the model folder: how the start was made, so a run can say what it started from."""


class Misreader:
    """The counter solver, reading the k-th number of the first user message as `n + offsets[k]`."""

    def __init__(self, offsets: Sequence[int]) -> None:
        from gymrpc.servers.model.backends.sources import CounterSolver

        self.offsets = tuple(offsets)
        self._solver = CounterSolver()

    def misread(self, text: str) -> str:
        numbers = iter(self.offsets)
        return _NUMBER.sub(lambda m: str(int(m.group()) + next(numbers, 0)), text)

    def reply(self, conversation: Any) -> str | None:
        from gymrpc.servers.model.backends.base import Conversation

        messages, seen = [], False
        for message in conversation.messages:
            if not seen and message.get("role") == "user":
                message, seen = {**message, "content": self.misread(message.get("content") or "")}, True
            messages.append(message)
        return self._solver.reply(Conversation(messages, conversation.tools, conversation.rollout_id))

    def describe(self) -> str:
        return f"counter solver misreading by {self.offsets}"


def mixture(rows: Sequence[Mapping[str, Any]], correct: float) -> list[tuple[Example, float]]:
    """Every task's episodes with each number right or one too high, each with its probability.

    A two-number task at `correct` 0.4 gives the right episode weight 0.16, the two with one
    near miss 0.24 each and the one with both 0.36.
    """
    from gymrpc.testing.scripted import counter_examples

    if not 0.0 < correct < 1.0:
        raise ValueError(f"correct must be between 0 and 1 (exclusive), got {correct}")
    out: list[tuple[Example, float]] = []
    for row in rows:
        count = len(_NUMBER.findall(_first_user_text(row)))
        for misses in itertools.product((0, 1), repeat=count):
            [example] = counter_examples([row], solver=Misreader(misses))
            out.append((example, correct ** (count - sum(misses)) * (1.0 - correct) ** sum(misses)))
    return out


def _first_user_text(row: Mapping[str, Any]) -> str:
    items = row["responses_create_params"]["input"]
    return next(m["content"] for m in items if m.get("role") == "user")


@dataclass(frozen=True)
class WeakStart:
    """How the start policy is made; the defaults are what `tests/vllm/test_trainer.py` measures."""

    correct: float = 0.4
    steps: int = 300
    """100 steps left the format fuzzy enough that about 8% of sampled episodes broke a tool call,
    which GRPO then had to sharpen away too (it plateaued at 0.75-0.86); 300 (about 40 s) leave the
    numbers as weak as before (the start still ends right about 16% of the time)."""
    lr: float = 3e-3
    tasks: int = 1
    """The first `tasks` rows of the counter's example tasks (more tasks take many more steps to tell apart)."""
    seed: int = 0


@dataclass(frozen=True)
class StartResult:
    steps: int
    loss: float
    seconds: float


def build_weak_start(
    out: Path, rows: Sequence[Mapping[str, Any]] | None = None, recipe: WeakStart = WeakStart()
) -> StartResult:
    """A fresh random tiny model fitted for `recipe.steps` to `mixture(rows)`, saved (with the tokenizer) to `out`."""
    from gymrpc.testing.scripted import counter_rows

    rows = counter_rows()[: recipe.tasks] if rows is None else rows
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tiny-base-") as tmp:
        build_tiny_model(Path(tmp), seed=recipe.seed)
        model, loss = _fit(Path(tmp), mixture(rows, recipe.correct), recipe)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    result = StartResult(recipe.steps, loss, time.monotonic() - started)
    info = {"recipe": recipe.__dict__, "tasks": len(rows), "loss": loss}
    (out / START_INFO).write_text(json.dumps(info, indent=1) + "\n")
    # The tasks it was made for: what `gymrpc train run --tasks` should train on.
    (out / TASKS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return result


def _fit(src: Path, weighted: Sequence[tuple[Example, float]], recipe: WeakStart) -> tuple[Any, float]:
    """Full-batch AdamW on the probability-weighted cross-entropy of the target tokens.

    Full batch, not sampled minibatches: the mixture's proportions are then exact at every step,
    and the fit is deterministic for a seed. At the optimum each near-miss branch has exactly
    its mixture probability, while every other target token is near certain.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from gymrpc.train.policy import token_logits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small shared CPU: spin-waiting OpenMP threads cost more than they give
    try:
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        pad = int(model.config.pad_token_id or 0)
        width = max(len(e.token_ids) for e, _ in weighted)
        ids = torch.full((len(weighted), width), pad, dtype=torch.long)
        mask = torch.zeros((len(weighted), width), dtype=torch.long)
        target = torch.zeros((len(weighted), width), dtype=torch.float32)
        for row, (example, weight) in enumerate(weighted):
            n = len(example.token_ids)
            ids[row, :n] = torch.tensor(example.token_ids)
            mask[row, :n] = 1
            # Each sequence's weight spread over its target tokens: a sequence counts as its probability.
            target[row, :n] = torch.tensor(example.target, dtype=torch.float32) * weight / sum(example.target)
        target = target[:, 1:] / target.sum()
        where = target > 0  # positions whose next token is learned
        wanted, weights = ids[:, 1:][where], target[where]
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        model.train()
        loss_value = float("nan")
        for step in range(1, recipe.steps + 1):
            logits = token_logits(model, ids, mask, where)
            nll = -logits.log_softmax(-1).gather(-1, wanted.unsqueeze(-1)).squeeze(-1)
            loss = (nll * weights).sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = loss.item()
            if step % 20 == 0:
                log.info("weak start: step %d loss %.4f", step, loss_value)
        return model, loss_value
    finally:
        torch.set_num_threads(threads)
