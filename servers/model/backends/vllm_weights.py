"""gymrpc's methods inside vLLM's worker processes: stage a safetensors folder, then swap it in.

vLLM mixes this class into every worker (`worker_extension_cls`), so the model server reaches
it by name through `AsyncLLM.collective_rpc` and tensors never cross a process boundary:

- `gymrpc_stage_weights(files)`: read every tensor into the worker's memory while generation
  goes on. A file that fails to read (truncated, corrupt) raises here, before anything changed.
- `gymrpc_apply_weights()`: inside the pause, load the staged tensors through vLLM's in-place
  reload (`reload_weights(weights_iterator=..., is_checkpoint_format=True)`), which re-runs each
  layer's weight processing; on a CPU the LM head's packed GEMM is then rebuilt from its new
  weight, which that reload leaves stale (vLLM 0.32).

This module imports only what vLLM's worker has (torch, safetensors); it must stay importable
by name in the engine's child processes.
"""

from __future__ import annotations

import json
from typing import Any

WEIGHTS_EXTENSION = "gymrpc.servers.model.backends.vllm_weights.WeightsExtension"
"""The `worker_extension_cls` value (`vllm serve --worker-extension-cls ...` for an upstream)."""


class WeightsExtension:
    """Mixed into vLLM's `Worker`; `self` is the worker (it has `model_runner`)."""

    _gymrpc_staged: list[tuple[str, Any]] | None = None

    def gymrpc_stage_weights(self, files: list[str] | str) -> int:
        """Read every tensor of `files` (a list, or its JSON: `/collective_rpc` passes strings) into memory."""
        from safetensors import safe_open

        if isinstance(files, str):
            files = json.loads(files)

        staged: list[tuple[str, Any]] = []
        total = 0
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = handle.get_tensor(name)
                    staged.append((name, tensor))
                    total += tensor.numel() * tensor.element_size()
        self._gymrpc_staged = staged
        return total

    def gymrpc_drop_staged(self) -> None:
        self._gymrpc_staged = None

    def gymrpc_apply_weights(self) -> int:
        """Load the staged tensors in place; the number loaded."""
        staged = self._gymrpc_staged
        if staged is None:
            raise RuntimeError("no weights are staged on this worker")
        self._gymrpc_staged = None
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        _repack_cpu_embedding_heads(runner.get_model())
        return len(staged)

    def gymrpc_weights_digest(self) -> str:
        """sha256 over every parameter and buffer as the model holds it (a test's witness)."""
        import hashlib

        digest = hashlib.sha256()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        for name, tensor in sorted({**dict(model.named_parameters()), **dict(model.named_buffers())}.items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


def _repack_cpu_embedding_heads(model: Any) -> None:
    """On a CPU, rebuild the packed GEMM of every embedding-method head (the LM head) from its new weight.

    vLLM packs the LM head for oneDNN (or sgl-kernel) into a closure while keeping its weight; the
    in-place reload refreshes the weight (tied heads share the embedding's) but not that closure,
    so without this the head would keep computing logits from the old weights.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ == "UnquantizedEmbeddingMethod" and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
