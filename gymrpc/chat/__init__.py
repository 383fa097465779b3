"""Chat templating, tokenization and tool-call parsing owned by gymrpc, not by a backend.

Every model backend receives the same prompt token ids and is decoded and parsed
the same way, so a trajectory's tokens do not depend on which backend served it.
"""

from __future__ import annotations

from gymrpc.chat.template import (
    DEFAULT_SYSTEM,
    GENERATION_PROMPT,
    ChatTemplate,
    CompletionMemory,
    Rendered,
    assistant_body,
)
from gymrpc.chat.tokenizer import ChatTokenizer, IncrementalDecoder, default_tokenizer
from gymrpc.chat.toolcalls import ParsedReply, ToolCall, format_tool_call, parse_reply

__all__ = [
    "DEFAULT_SYSTEM",
    "GENERATION_PROMPT",
    "ChatTemplate",
    "ChatTokenizer",
    "CompletionMemory",
    "IncrementalDecoder",
    "ParsedReply",
    "Rendered",
    "ToolCall",
    "assistant_body",
    "default_tokenizer",
    "format_tool_call",
    "parse_reply",
]
