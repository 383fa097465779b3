"""The tiny test model: its HF chat template renders what gymrpc's template renders, and it loads
in transformers with our token ids. No engine: these need only the vllm tier's torch and transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gymrpc.chat import ChatTemplate, default_tokenizer
from gymrpc.testing.scripted import counter_examples, counter_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {"type": "object"}}},
    {"name": "bare", "description": "a tool given without the function wrapper", "parameters": {}},
]
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "plain": ([{"role": "user", "content": "Hi"}], []),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], []),
    "empty-system": ([{"role": "developer", "content": ""}, {"role": "user", "content": "Hi"}], TOOLS),
    "tools": (
        [
            {"role": "user", "content": "Weather in Paris and Oslo? ünïcödé"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Ö"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "rain"},
            {
                "role": "assistant",
                "content": "Checking once more.",
                "reasoning_content": "Oslo again",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}],
            },
            {"role": "tool", "content": "snow"},
            {"role": "assistant", "content": "Sunny, then snow."},
            {"role": "system", "content": "A late system note."},
            {"role": "user", "content": "Thanks"},
        ],
        TOOLS,
    ),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_hf_chat_template_renders_what_gymrpc_renders(random_model: Path, name: str) -> None:
    from transformers import AutoTokenizer

    messages, tools = CONVERSATIONS[name]
    hf = AutoTokenizer.from_pretrained(random_model)
    theirs = hf.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
    assert theirs == ChatTemplate(default_tokenizer()).render(messages, tools).text


def test_model_directory_is_our_tokenizer_and_a_qwen2_config(random_model: Path) -> None:
    config = json.loads((random_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] >= default_tokenizer().vocab_size
    assert (random_model / "tokenizer.json").is_file()
    assert (random_model / "model.safetensors").stat().st_size < 4_000_000


def test_counter_model_greedily_replays_its_training_episode(counter_model: Path) -> None:
    """Teacher-forced, every trained completion token is the argmax: what makes the stack test exact."""
    import torch
    from transformers import AutoModelForCausalLM

    (example,) = counter_examples(counter_rows()[:1])
    model = AutoModelForCausalLM.from_pretrained(counter_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([example.token_ids])).logits[0, :-1]
    wanted = torch.tensor(example.token_ids[1:])
    trained = torch.tensor(example.target[1:])
    assert bool((logits.argmax(-1) == wanted)[trained].all())
    assert int(trained.sum()) > 30  # increments, read and answer
