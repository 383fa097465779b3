"""A tiny Qwen2 model directory built from code, so the real-vLLM tier needs no download.

`build_tiny_model(dir)` writes what vLLM and transformers load offline: `config.json`, random
weights from a fixed seed (`model.safetensors`), `generation_config.json`, and gymrpc's own
tokenizer (`gymrpc/chat/data/tokenizer.json`) wrapped for HF with a jinja chat template that
renders exactly the text `gymrpc.chat.ChatTemplate` renders. Using our tokenizer is the point:
the model server templates and tokenizes, so the model's vocabulary must be ours. A copy of
the tokenizer alone in `tokenizer/` is what `vllm serve --tokenizer` should load (`TOKENIZER_SUBDIR`).

`train_scripted(src, out, examples)` overfits such a model on token sequences with a loss on
chosen spans only, until greedy decoding reproduces every target token with a wide margin
(`reference/vllm.md` §2: a small margin lets tiny numeric differences between backends flip
a token). Random weights only ever babble; a trained model makes multi-turn tests meaningful.

    python -m gymrpc.testing.tiny_model OUT_DIR            # random weights, ~5 s
    python -m gymrpc.testing.tiny_model OUT_DIR --counter  # plus a counter-solving fine-tune

torch and transformers are imported inside the functions: they are in `.venv-vllm` only.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.chat.template import DEFAULT_SYSTEM, TOOLS_POSTAMBLE, TOOLS_PREAMBLE
from gymrpc.chat.tokenizer import DEFAULT_TOKENIZER, ENDOFTEXT, IM_END

log = logging.getLogger(__name__)


def _lit(text: str) -> str:
    """A jinja string literal (JSON escapes are jinja escapes for these ASCII strings)."""
    return json.dumps(text)


# Mirrors `gymrpc.chat.template.ChatTemplate.render` (text, not ids); tests/vllm compares the two.
CHAT_TEMPLATE = (
    """{%- set sys_roles = ['system', 'developer'] -%}
{%- if messages and messages[0].role in sys_roles -%}
{%- set system = messages[0].content or '' -%}
{%- else -%}
{%- set system = """
    + _lit(DEFAULT_SYSTEM)
    + """ -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
{{- """
    + _lit(TOOLS_PREAMBLE)
    + """ -}}
{%- for tool in tools -%}
{{- '\\n' -}}
{%- if tool.function is defined -%}{{- tool | tojson -}}
{%- else -%}{{- {'type': 'function', 'function': tool} | tojson -}}{%- endif -%}
{%- endfor -%}
{{- """
    + _lit(TOOLS_POSTAMBLE)
    + """ -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in messages -%}
{%- if loop.first and message.role in sys_roles -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if message.reasoning_content -%}{{- '<think>' + message.reasoning_content + '</think>' -}}{%- endif -%}
{%- set content = message.content or '' -%}
{{- content -}}
{%- for call in message.tool_calls or [] -%}
{%- set function = call.function if call.function is defined else call -%}
{%- if not loop.first or content -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": ' + (function.name | tojson) + ', "arguments": ' -}}
{%- if function.arguments is not defined -%}{{- '{}' -}}
{%- elif function.arguments is string -%}{{- function.arguments -}}
{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + ('system' if message.role in sys_roles else 'user') + '\\n' -}}
{{- (message.content or '') + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)


@dataclass(frozen=True)
class TinyShape:
    """The architecture; the defaults are `reference/vllm.md` §2's 0.56M-parameter model."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    """64 stays within the head sizes vLLM's CPU attention kernel supports."""
    max_position_embeddings: int = 4096


def hf_tokenizer(tokenizer_file: Path = DEFAULT_TOKENIZER) -> Any:
    """Our `tokenizer.json` as a transformers fast tokenizer, with the matching chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TinyShape.max_position_embeddings
    return tokenizer


TOKENIZER_SUBDIR = "tokenizer"
"""The tokenizer again, alone, for loaders that go through transformers (`vllm serve --tokenizer`).

transformers 5 loads the tokenizer of any `qwen2` model folder as `Qwen2Tokenizer`, whose
pre-tokenizer (digits one by one) replaces the one in `tokenizer.json`, so ` 1` would no longer
be the one token the model was trained on. From a folder without `config.json` it loads
`tokenizer.json` as written.
"""


def save_tokenizer(out: Path) -> Any:
    """Write our HF tokenizer into the model folder `out` and into `out/tokenizer`; returns it."""
    tokenizer = hf_tokenizer()
    tokenizer.save_pretrained(out)
    tokenizer.save_pretrained(out / TOKENIZER_SUBDIR)
    return tokenizer


def build_tiny_model(out: Path, *, seed: int = 0, shape: TinyShape = TinyShape()) -> Path:
    """Write a random-weight Qwen2 model directory to `out` (created); returns `out`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out)
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    return out


@dataclass(frozen=True)
class Example:
    """One training sequence; `target[i]` says whether token i is learned (predicted from i-1)."""

    token_ids: tuple[int, ...]
    target: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.target):
            raise ValueError("token_ids and target differ in length")


@dataclass(frozen=True)
class TrainResult:
    steps: int
    loss: float
    min_target_prob: float
    """The smallest probability the trained model gives any target token (teacher-forced)."""
    seconds: float


def train_scripted(
    src: Path,
    out: Path,
    examples: Sequence[Example],
    *,
    max_steps: int = 600,
    lr: float = 3e-3,
    min_prob: float = 0.995,
    check_every: int = 20,
    batch_size: int = 16,
    seed: int = 0,
) -> TrainResult:
    """Fine-tune the model in `src` on `examples` and save it (with the tokenizer) to `out`.

    Stops as soon as every target token is the argmax with probability >= `min_prob`, so the
    run is as short as the data allows; raises if `max_steps` is not enough.
    """
    import torch

    started = time.monotonic()
    threads = torch.get_num_threads()
    # One thread: on a small shared CPU, OpenMP threads that spin-wait for each other cost more than they give.
    torch.set_num_threads(1)
    try:
        result = _train(src, examples, max_steps, lr, min_prob, check_every, batch_size, seed)
    finally:
        torch.set_num_threads(threads)
    model, steps, loss, prob = result
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    return TrainResult(steps, loss, prob, time.monotonic() - started)


def _train(
    src: Path,
    examples: Sequence[Example],
    max_steps: int,
    lr: float,
    min_prob: float,
    check_every: int,
    batch_size: int,
    seed: int,
) -> tuple[Any, int, float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    pad = int(model.config.pad_token_id or 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def batch(items: Sequence[Example]) -> tuple[Any, Any, Any]:
        width = max(len(e.token_ids) for e in items)
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        labels = torch.full((len(items), width), -100, dtype=torch.long)
        for row, example in enumerate(items):
            n = len(example.token_ids)
            ids[row, :n] = torch.tensor(example.token_ids)
            mask[row, :n] = 1
            picked = [t if keep else -100 for t, keep in zip(example.token_ids, example.target, strict=True)]
            labels[row, :n] = torch.tensor(picked)
        return ids, mask, labels

    @torch.no_grad()
    def worst_prob() -> float:
        worst = 1.0
        model.eval()
        for start in range(0, len(examples), batch_size):
            ids, mask, labels = batch(examples[start : start + batch_size])
            probs = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().softmax(-1)
            wanted = labels[:, 1:]
            keep = wanted != -100
            picked = probs.gather(-1, wanted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            is_max = probs.argmax(-1) == wanted
            worst = min(worst, float(torch.where(keep & is_max, picked, torch.where(keep, 0.0, 1.0)).min()))
        model.train()
        return worst

    loss_value, prob = float("nan"), 0.0
    model.train()
    for step in range(1, max_steps + 1):
        items = list(examples) if len(examples) <= batch_size else rng.sample(list(examples), batch_size)
        ids, mask, labels = batch(items)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        if step % check_every == 0:
            prob = worst_prob()
            log.info("step %d loss %.4f worst target prob %.4f", step, loss_value, prob)
            if prob >= min_prob:
                break
    else:
        raise RuntimeError(f"after {max_steps} steps the worst target token has p={prob:.4f} < {min_prob}")
    return model, step, loss_value, prob


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gymrpc.testing.tiny_model", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--counter", action="store_true", help="fine-tune to solve the counter example tasks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.counter:
        build_tiny_model(args.out, seed=args.seed)
        print(f"wrote {args.out}")
        return
    from gymrpc.testing.scripted import build_counter_model

    result = build_counter_model(args.out, seed=args.seed)
    print(f"wrote {args.out}: {result}")


if __name__ == "__main__":
    main()
