"""The protocol reference in docs/reference is rendered from the .proto comments and kept current."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen_docs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_committed_reference_matches_the_protos(gen_docs, tmp_path: Path) -> None:
    missing = gen_docs.render(tmp_path)
    assert gen_docs.differences(tmp_path, gen_docs.OUT) == [], "docs/reference is stale: run tools/gen_docs.py"
    assert missing == [], f"undocumented definitions in protos/: {missing}"


def test_reference_links_resolve_to_anchors(gen_docs) -> None:
    pages = {p.name: p.read_text() for p in gen_docs.OUT.glob("*.md")}
    anchors = {name: set(re.findall(r'<a id="([^"]+)"></a>', text)) for name, text in pages.items()}
    for name, text in pages.items():
        for page, anchor in re.findall(r"\]\(([a-z_]*\.md)?#([^)]+)\)", text):
            assert anchor in anchors[page or name], f"{name}: broken link {page}#{anchor}"


def test_pages_show_types_streams_and_comments(gen_docs) -> None:
    agent = (gen_docs.OUT / "agent_service.md").read_text()
    assert "| [`RunStream`](#gymrpc.v1.AgentService.RunStream) |" in agent
    assert "stream [`RunStreamResponse`](#gymrpc.v1.RunStreamResponse)" in agent
    assert "| `episode_id` | [`EpisodeId`](common.md#gymrpc.v1.EpisodeId) | 2 |" in agent
    assert "One of `event`." in agent
    participant = (gen_docs.OUT / "participant_service.md").read_text()
    assert "map<`string`, `uint64`>" in participant
    assert "    idle --Prepare--> preparing" in participant  # indented comment lines stay a code block
    common = (gen_docs.OUT / "common.md").read_text()
    assert "| `temperature` | optional `double` |" in common
