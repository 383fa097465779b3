"""The chat template, in Python: messages + tools -> prompt text and token ids.

The text format is Qwen2.5's hermes template (`reference/vllm.md` Appendix B): a
system block that lists the tools, `<|im_start|>{role}\\n...<|im_end|>\\n` turns,
assistant tool calls as `<tool_call>` JSON blocks, and consecutive tool results
grouped into one user turn of `<tool_response>` blocks.

Token ids are made piece by piece (turn headers, bodies, closers are encoded
separately and concatenated), never by encoding the whole string at once. That
makes rendering prefix-stable: the prompt after an assistant reply and its tool
results starts with exactly the previous prompt ids followed by the completion
ids, because the generation prompt is its own piece and the assistant body is
either the completion's own ids (remembered in a `CompletionMemory`) or the
encoding of its canonical text, which is what the scripted backend generates.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gymrpc.chat.tokenizer import IM_END, IM_START, ChatTokenizer
from gymrpc.chat.toolcalls import THINK_CLOSE, THINK_OPEN, format_tool_call

DEFAULT_SYSTEM = "You are a helpful assistant."
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)
GENERATION_PROMPT = f"{IM_START}assistant\n"
_SYSTEM_ROLES = ("system", "developer")

Message = Mapping[str, Any]


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    text: str


def assistant_body(message: Message) -> str:
    """The canonical text of an assistant turn between its header and `<|im_end|>`.

    `parse_reply(assistant_body(m))` gives back m's content, reasoning and calls, so a
    reply generated in this form re-renders to the same tokens.
    """
    text = f"{THINK_OPEN}{message['reasoning_content']}{THINK_CLOSE}" if message.get("reasoning_content") else ""
    content = message.get("content") or ""
    text += content
    for k, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function", call)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        text += ("\n" if k > 0 or content else "") + format_tool_call(function["name"], arguments)
    return text


def tool_json(tool: Mapping[str, Any]) -> str:
    """One tool line inside `<tools>`: the OpenAI function-tool object, as jinja's `tojson` writes it."""
    if "function" not in tool:
        tool = {"type": "function", "function": dict(tool)}
    return json.dumps(tool, ensure_ascii=False)


class CompletionMemory:
    """Remembers the exact ids of recent completions, keyed by their prompt and parsed message.

    A real model may write a call with other spacing than the canonical form, or
    tokenize text unusually; re-rendering its parsed message would then change the
    ids. Rendering looks the reply up here first, so it re-renders as generated.
    Bounded (LRU); after a restart it is empty and rendering falls back to the
    canonical text.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()  # the model server renders in worker threads

    def remember(self, prompt_ids: Sequence[int], message: Message, completion_ids: Sequence[int]) -> None:
        key = self._key(prompt_ids, message)
        with self._lock:
            self._ids[key] = tuple(completion_ids)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def recall(self, prompt_ids: Sequence[int], message: Message) -> tuple[int, ...] | None:
        key = self._key(prompt_ids, message)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    @staticmethod
    def _key(prompt_ids: Sequence[int], message: Message) -> str:
        calls = [
            [c.get("function", c).get("name"), c.get("function", c).get("arguments")]
            for c in message.get("tool_calls") or ()
        ]
        rendered = [message.get("content") or "", message.get("reasoning_content") or "", calls]
        digest = hashlib.sha256(array("q", prompt_ids).tobytes())
        digest.update(json.dumps(rendered, sort_keys=True, default=str).encode())
        return digest.hexdigest()


class ChatTemplate:
    """Renders conversations with one tokenizer; stateless except for the optional memory."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        default_system: str = DEFAULT_SYSTEM,
        memory: CompletionMemory | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.memory = memory

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        ids: list[int] = []
        texts: list[str] = []

        def put(text: str) -> None:
            ids.extend(self.tokenizer.encode(text))
            texts.append(text)

        def put_ids(token_ids: Sequence[int]) -> None:
            ids.extend(token_ids)
            texts.append(self.tokenizer.decode(token_ids))

        messages = list(messages)
        first_is_system = bool(messages) and messages[0].get("role") in _SYSTEM_ROLES
        system = (messages[0].get("content") or "") if first_is_system else self.default_system
        put(f"{IM_START}system\n")
        if system:
            put(system)
        if tools:
            put(TOOLS_PREAMBLE + "".join("\n" + tool_json(t) for t in tools) + TOOLS_POSTAMBLE)
        put(f"{IM_END}\n")
        for index, message in enumerate(messages):
            if index == 0 and first_is_system:
                continue
            role = message.get("role")
            if role == "assistant":
                put(GENERATION_PROMPT)
                remembered = self.memory.recall(ids, message) if self.memory is not None else None
                if remembered is not None:
                    put_ids(remembered)
                    if not remembered or remembered[-1] != self.tokenizer.im_end_id:
                        put_ids([self.tokenizer.im_end_id])
                else:
                    put(assistant_body(message))
                    put_ids([self.tokenizer.im_end_id])
                put("\n")
            elif role == "tool":
                if index == 0 or messages[index - 1].get("role") != "tool":
                    put(f"{IM_START}user")
                put("\n<tool_response>\n")
                put(message.get("content") or "")
                put("\n</tool_response>")
                if index == len(messages) - 1 or messages[index + 1].get("role") != "tool":
                    put(f"{IM_END}\n")
            else:
                # user, later system/developer turns, and any role a newer client invents (as user text)
                shown = "system" if role in _SYSTEM_ROLES else "user"
                put(f"{IM_START}{shown}\n")
                put(message.get("content") or "")
                put(f"{IM_END}\n")
        if add_generation_prompt:
            put(GENERATION_PROMPT)
        return Rendered(ids, "".join(texts))
