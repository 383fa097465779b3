"""The tokenizer the model server renders prompts and decodes completions with.

One tokenizer for every backend is what makes token ids comparable across them.
The default is the tiny byte-level BPE shipped in `data/tokenizer.json` (built by
`tools/make_tokenizer.py`); any HF `tokenizer.json` with the same special tokens
(for example a real Qwen model's) can be loaded instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

DEFAULT_TOKENIZER = Path(__file__).parent / "data" / "tokenizer.json"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
REQUIRED_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>")
LONG_TEXT = 1 << 16
"""Characters beyond which `encode` releases the GIL: `Tokenizer.encode` holds it throughout."""


class ChatTokenizer:
    """Text <-> token ids; special tokens written in text encode to their single ids."""

    def __init__(self, tokenizer: Tokenizer, name: str = "custom") -> None:
        ids = {t: tokenizer.token_to_id(t) for t in REQUIRED_SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer {name} lacks the special tokens {missing}")
        special = {t: i for t, i in ids.items() if i is not None}
        self._tokenizer = tokenizer
        self.name = name
        self.im_start_id = special[IM_START]
        self.im_end_id = special[IM_END]
        self.endoftext_id = special[ENDOFTEXT]
        self.stop_token_ids: tuple[int, ...] = (self.im_end_id, self.endoftext_id)
        """Ids that end an assistant turn (the generation config's `eos_token_id`)."""

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTokenizer:
        return cls(Tokenizer.from_file(str(path)), name=str(path))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:  # the batch call lets other threads run meanwhile; the ids are the same
            return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Exact inverse of `encode` for byte-level vocabularies; special tokens are kept as text."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def strip_stop(self, token_ids: Sequence[int]) -> list[int]:
        """The completion without its final stop token, i.e. the ids whose text is the reply."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return ids

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Turns streamed token ids into text deltas without splitting a UTF-8 character.

    Byte-level tokens can end in the middle of a multi-byte character; decoding
    them alone would emit U+FFFD. Such a tail is held back until it completes.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self._emitted = text[self._emitted :], len(text)
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        delta, self._emitted = text[self._emitted :], len(text)
        return delta


@functools.cache
def default_tokenizer() -> ChatTokenizer:
    """The shipped tiny tokenizer, loaded once per process."""
    return ChatTokenizer.from_file(DEFAULT_TOKENIZER)
