"""A tiny model fine-tuned to play the counter environment, for multi-turn tests on real vLLM.

The training sequences are whole counter episodes exactly as the model server sees them:
each turn's request goes through the server's own validation (`check_request`) and chat
template, the reply is what the scripted `CounterSolver` says, and the tool results come
from a real `CounterEnvironment` session. Loss is on the completions only. Because the
template is prefix-stable, one episode is one sequence: the last prompt plus its completion
contains every earlier prompt and completion.

Lives in `gymrpc.testing` and imports `gymrpc.servers` and `gymrpc.envs` lazily, inside the
functions that need them: test support, not library code, and importing `gymrpc.testing` pulls in
no server or environment.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gymrpc.testing.tiny_model import Example, TrainResult, build_tiny_model, train_scripted


def counter_rows() -> list[dict[str, Any]]:
    """The counter's bundled example tasks (JSONL rows)."""
    import gymrpc.envs.counter

    path = gymrpc.envs.counter.example_tasks_path()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def counter_examples(rows: Sequence[Mapping[str, Any]], solver: Any = None) -> list[Example]:
    """One training sequence per task row: the whole episode `solver` plays (default: `CounterSolver`)."""
    from gymrpc.chat import ChatTemplate, default_tokenizer, parse_reply
    from gymrpc.envs.counter import CounterEnvironment
    from gymrpc.messages import message_from_dict, task_from_row, task_spec
    from gymrpc.servers.model.backends.base import Conversation
    from gymrpc.servers.model.backends.sources import CounterSolver
    from gymrpc.servers.model.requests import Limits, check_request
    from gymrpc.v1 import common_pb2
    from gymrpc.v1 import model_service_pb2 as pb

    tokenizer = default_tokenizer()
    template = ChatTemplate(tokenizer)
    solver = CounterSolver() if solver is None else solver
    examples = []
    for index, row in enumerate(rows):
        task = task_from_row(row, str(index))
        session, _ = CounterEnvironment().seed(task_spec(task))
        messages = list(task.input)
        turns: list[tuple[list[int], list[int]]] = []
        for turn in range(10):
            request = pb.GenerateRequest(request_id=f"train-{index}-{turn}", messages=messages, tools=task.tools)
            checked = check_request(request, Limits(), tokenizer.stop_token_ids)
            prompt = template.render(checked.messages, checked.tools).token_ids
            text = solver.reply(Conversation(checked.messages, checked.tools))
            if text is None:
                raise ValueError(f"the counter solver cannot play task {index}")
            turns.append((prompt, [*tokenizer.encode(text), tokenizer.im_end_id]))
            reply = message_from_dict(parse_reply(text, id_prefix=f"call_{turn}").to_message())
            messages.append(reply)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                result = session.call_tool(call.name, json.loads(call.arguments_json))
                messages.append(
                    common_pb2.Message(
                        role=common_pb2.ROLE_TOOL, content=result.output, tool_call_id=call.id, name=call.name
                    )
                )
        prompt, completion = turns[-1]
        ids = [*prompt, *completion]
        target = [False] * len(ids)
        for prompt, completion in turns:
            end = len(prompt) + len(completion)
            if ids[:end] != [*prompt, *completion]:
                raise AssertionError(f"task {index}: a turn's prompt does not extend the previous one")
            target[len(prompt) : end] = [True] * len(completion)
        examples.append(Example(tuple(ids), tuple(target)))
    return examples


def build_counter_model(
    out: Path,
    rows: Sequence[Mapping[str, Any]] | None = None,
    *,
    base: Path | None = None,
    seed: int = 0,
    **train: Any,
) -> TrainResult:
    """`base` (default: a fresh random tiny model) trained on `counter_examples(rows)`, saved to `out`.

    The default is the first example task only: one sequence is memorised in ~80 steps,
    while telling several tasks apart first needs a slow, seed-sensitive phase (five tasks
    plateaued ~150 steps at lr 3e-3 and diverged at 5e-3).
    """
    rows = counter_rows()[:1] if rows is None else rows
    if base is not None:
        return train_scripted(base, out, counter_examples(rows), seed=seed, **train)
    with tempfile.TemporaryDirectory(prefix="tiny-base-") as tmp:
        build_tiny_model(Path(tmp), seed=seed)
        return train_scripted(Path(tmp), out, counter_examples(rows), seed=seed, **train)
