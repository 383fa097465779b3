"""Model-server prompt CPU per episode: full renders against incremental prompts, on workplace-sized conversations.

Each episode is `--calls` model calls of one growing conversation, as the model server
sees them: the workplace system prompt and its 26 tool schemas, the task, then per turn an
assistant tool call and a tool response of `--response-chars` characters (a table excerpt,
as workplace tools return). Every call renders and tokenises the whole prompt, once with
the plain `ChatTemplate` (what the server did before) and once through
`gymrpc.servers.model.prompts.PromptTokenizer` (pieces of the previous call reused when their text
is byte-identical). Episodes alternate the two, so machine load hits both alike; the
figure is process CPU per episode (the median over `--episodes`), and the two renders are
checked to be identical.

    .venv/bin/python bench/prompts.py [--episodes N] [--calls N] [--response-chars N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gymrpc.chat import ChatTemplate, default_tokenizer  # noqa: E402
from gymrpc.envs.workplace_assistant._data import load_tool_specs  # noqa: E402
from gymrpc.servers.model.prompts import PromptTokenizer  # noqa: E402

SYSTEM = (
    "Today's date is Thursday, 2023-11-30 and the current time is 23:59:00. Remember the current date and time "
    "when answering queries. Meetings must not start before 9am or end after 6pm. "
)


def conversation(episode: int, calls: int, response_chars: int) -> list[list[dict[str, Any]]]:
    """The messages of each call of one episode (call k sees k turns)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM * 4},
        {"role": "user", "content": f"Episode {episode}: reassign every task of Nadia in the backend team to Raj."},
    ]
    per_call = []
    for turn in range(calls):
        per_call.append(list(messages))
        arguments = json.dumps({"field": "assigned_to_email", "value": f"nadia.{episode}@atlas.com", "turn": turn})
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "project_management_search_tasks", "arguments": arguments}}],
            }
        )
        row = f'{{"task_id": "{turn:08d}", "task_name": "Fix bug {episode}-{turn}", "board": "Back end"}}, '
        messages.append({"role": "tool", "content": "[" + (row * (response_chars // len(row) + 1))[:response_chars]})
    return per_call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=20, help="episodes per side (default %(default)s)")
    parser.add_argument("--calls", type=int, default=12, help="model calls per episode (default %(default)s)")
    parser.add_argument("--response-chars", type=int, default=3000, help="characters per tool response")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    tokenizer = default_tokenizer()
    tools = [
        {"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in load_tool_specs()
    ]
    plain = ChatTemplate(tokenizer)
    incremental = PromptTokenizer(tokenizer)
    cached = ChatTemplate(incremental)  # type: ignore[arg-type]
    cpu: dict[str, list[float]] = {"full": [], "incremental": []}
    tokens = 0
    for episode in range(args.episodes):
        calls = conversation(episode, args.calls, args.response_chars)
        order = [("full", plain), ("incremental", cached)]
        for side, template in order if episode % 2 == 0 else reversed(order):
            started = time.process_time()
            rendered = [template.render(messages, tools).token_ids for messages in calls]
            cpu[side].append(time.process_time() - started)
            if side == "full":
                reference = rendered
                tokens = len(rendered[-1])
            else:
                incremental_ids = rendered
        if incremental_ids != reference:
            raise SystemExit(f"episode {episode}: the incremental render differs from the full render")
    full, inc = statistics.median(cpu["full"]), statistics.median(cpu["incremental"])
    print(f"{args.episodes} episodes per side, {args.calls} model calls each, last prompt {tokens} tokens")
    print(f"full render        {full * 1e3:8.1f} ms CPU per episode")
    print(
        f"incremental render {inc * 1e3:8.1f} ms CPU per episode   (piece hits {incremental.hits}, misses "
        f"{incremental.misses})"
    )
    print(f"RATIO full / incremental: {full / inc:.1f}x less prompt CPU per episode")
    if args.json:
        args.json.write_text(json.dumps({"full_ms": full * 1e3, "incremental_ms": inc * 1e3, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
