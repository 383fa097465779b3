"""Build the tiny byte-level BPE tokenizer shipped in `gymrpc/chat/data/tokenizer.json`.

The model server owns tokenization, so tests and the no-GPU demo need a real
tokenizer without any download. This one follows `reference/vllm.md` §2 (special
tokens first, `vocab_size=2048`, byte-level so every string round-trips), but is
trained on a corpus generated here rather than on stdlib docstrings: docstrings
change between Python versions, and the output must be reproducible.

    python tools/make_tokenizer.py            # rewrite the shipped file
    python tools/make_tokenizer.py --check    # fail if the shipped file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "gymrpc" / "chat" / "data" / "tokenizer.json"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

_PROSE = """\
You are a helpful assistant. Answer the user's question as well as you can.
You may call one or more functions to assist with the user query.
You are provided with function signatures within <tools></tools> XML tags.
For each function call, return a json object with function name and arguments.
The counter starts at a value chosen by the task. Add the numbers in order, then read the count.
I added the numbers and then checked the counter. The current count is shown below.
You are playing Blackjack. After seeing your hand, respond with hit or stand.
Your hand is strong, so I will stand. The dealer shows an ace, so I will hit.
Today's date is Thursday and the current time is late in the evening.
Remember the current date and time when answering queries about meetings.
Meetings must not start before nine in the morning or end after six in the evening.
Please send an email to the team about the project status and the next deadline.
Create a bar chart of total visits since the start of the month.
Move all customers that have not responded to a proposal to lost, and update the records.
The function returned an error. Let me check the arguments and try again.
There are no results for this query. Would you like me to search for something else?
Here is a summary of the results: three tasks are done, two are in progress, one is blocked.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Training a policy with reinforcement learning needs rollouts, rewards, and token logprobs.
Each episode seeds a session, asks the model, runs the tool calls, and verifies the result.
A checkpoint saves the state of every participant so that a crash does not lose the work.
If the server restarts, the client resolves the stable name again and retries the call.
def main() -> None: return None
class Session: pass
for item in items: print(item)
import json, re, asyncio
"""


def corpus() -> Iterator[str]:
    """A deterministic training corpus: prose, chat-template text and tool-call JSON."""
    lines = _PROSE.splitlines()
    for _ in range(20):
        yield from lines
    for _ in range(20):
        for role in ("system", "user", "assistant", "tool"):
            yield f"<|im_start|>{role}\nHello there.<|im_end|>\n"
    for a in range(0, 60):
        b = (a * 7 + 3) % 50
        yield f"add {a} then add {b} then get the count"
        yield f'<tool_call>\n{{"name": "increment_counter", "arguments": {{"count": {a}}}}}\n</tool_call>'
        yield '<tool_call>\n{"name": "get_counter_value", "arguments": {}}\n</tool_call>'
        yield f'<tool_response>\n{{"count": {a + b}}}\n</tool_response>'
        yield '<tool_response>\n{"success": true}\n</tool_response>'
        yield f"The current count is {a + b}."
        yield f"Your hand: [{a % 10 + 1}, {b % 10 + 1}] = {a % 10 + b % 10 + 2}\nDealer shows: A"
        yield f"Meeting on 2023-11-{a % 28 + 1:02d} at {a % 9 + 9}:{b % 60:02d}, id {a * 131 % 997:08d}."
    for n in range(1000):
        yield f"{n} {n * 37 % 1000} {n / 8:.3f} -{n}"
    yield json.dumps(
        {
            "type": "object",
            "properties": {"count": {"type": "integer", "description": ""}},
            "required": ["count"],
            "additionalProperties": False,
        }
    )


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {index}")
    return tokenizer


def serialize(tokenizer: Tokenizer) -> str:
    # Sorted keys and fixed indentation: the file is a diffable, byte-stable artifact.
    return json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, ensure_ascii=False, indent=None) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args()
    text = serialize(build())
    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} is stale: run python tools/make_tokenizer.py", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
