"""The trained policy in plain PyTorch: the GRPO loss, an optimizer step, weights out as safetensors.

The loss is PPO's clipped surrogate on generated tokens only, token-mean over the batch (every
trained token weighs the same, however long its episode):

    ratio = exp(logp_new - logp_old)
    loss  = -mean over trained tokens of min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

`logp_old` is what the model server sampled the token with; the trainer's weights may be one
version ahead (the next batch was already running while this step was taken), and the ratio
corrects for that while the clip keeps one step from trusting stale samples too far.

torch and transformers are imported inside the functions: they are in `.venv-vllm` only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.train.samples import Sample

WEIGHTS_FILES = ("model.safetensors", "config.json", "generation_config.json")


@dataclass(frozen=True)
class StepStats:
    loss: float
    trained_tokens: int
    clipped: float
    """Fraction of trained tokens whose ratio was clipped."""
    kl: float
    """Mean of logp_old - logp_new over trained tokens (an estimate of KL(old || new))."""
    grad_norm: float


@dataclass(frozen=True)
class Hyper:
    lr: float = 3e-4
    """Measured on the weak start: 3e-3 wrecks it in one step (Adam's first steps move every weight
    by about lr, the format's included); 3e-4 goes 0.125 -> 1.0 in five iterations of 8 episodes."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    """Sequences per forward/backward; the step is still one optimizer step over the whole batch."""


class Policy:
    """A causal LM and its AdamW optimizer; one `step` per batch of samples."""

    def __init__(self, model_dir: Path, hyper: Hyper = Hyper(), *, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        # One thread: on a small shared CPU, OpenMP threads that spin-wait for each other cost more than they give.
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.hyper = hyper
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.pad = int(self.model.config.pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=hyper.lr, betas=(0.9, 0.99), weight_decay=0.0)

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """One optimizer step on `samples` (advantages set); samples with advantage 0 only count tokens."""
        import torch

        rows = [(seq, s.advantage) for s in samples for seq in s.sequences if seq.trained_tokens]
        total = sum(seq.trained_tokens for seq, _ in rows)
        if total == 0:
            return StepStats(0.0, 0, 0.0, 0.0, 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = kl = 0.0
        for start in range(0, len(rows), self.hyper.micro_batch):
            chunk = rows[start : start + self.hyper.micro_batch]
            if all(a == 0.0 for _, a in chunk):
                continue  # no gradient; their tokens still count in `total`
            loss, n_clipped, kl_sum = self._loss(chunk)
            (loss / total).backward()
            loss_sum += float(loss)
            clipped += n_clipped
            kl += kl_sum
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper.max_grad_norm))
        self.optimizer.step()
        return StepStats(loss_sum / total, total, clipped / total, kl / total, norm)

    def _loss(self, chunk: Sequence[tuple[Any, float]]) -> tuple[Any, int, float]:
        """Summed (not averaged) clipped surrogate of `chunk`, clipped-token count, summed KL estimate."""
        import torch

        width = max(len(seq.token_ids) for seq, _ in chunk)
        n = len(chunk)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        trained = torch.zeros((n, width), dtype=torch.bool)
        old = torch.zeros((n, width), dtype=torch.float32)
        advantage = torch.zeros((n, 1), dtype=torch.float32)
        for row, (seq, adv) in enumerate(chunk):
            length = len(seq.token_ids)
            ids[row, :length] = torch.tensor(seq.token_ids)
            attention[row, :length] = 1
            trained[row, :length] = torch.tensor(seq.trained)
            old[row, :length] = torch.tensor(seq.old_logprobs)
            advantage[row, 0] = adv
        where = trained[:, 1:]
        logits = token_logits(self.model, ids, attention, where)
        new = logits.log_softmax(-1).gather(-1, ids[:, 1:][where].unsqueeze(-1)).squeeze(-1)
        old = old[:, 1:][where]
        old = torch.where(torch.isnan(old), new.detach(), old)  # no sampled logprob: on-policy (ratio 1)
        adv = advantage.expand(-1, where.shape[1])[where]
        ratio = torch.exp(new - old)
        low, high = 1.0 - self.hyper.clip_low, 1.0 + self.hyper.clip_high
        surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        loss = -surrogate.sum()
        n_clipped = int(((ratio < low) | (ratio > high)).sum())
        kl_sum = float((old - new.detach()).sum())
        return loss, n_clipped, kl_sum

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- files ---------------------------------------------------------------------------------

    def save_weights(self, folder: Path) -> Path:
        """A safetensors folder the model server can load (weights, config), written then renamed."""
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        _fsync_tree(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        _fsync_dir(folder.parent)
        return folder

    def save_state(self, folder: Path) -> None:
        """Weights, optimizer and torch RNG into `folder` (created), fsynced."""
        import torch

        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder / "weights", safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}, folder / "optimizer.pt")
        _fsync_tree(folder)

    def load_state(self, folder: Path) -> None:
        """The reverse of `save_state` (the weights are loaded in place, the optimizer keeps its moments)."""
        import torch
        from safetensors.torch import load_file

        weights = load_file(folder / "weights" / "model.safetensors")
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        # A tied lm_head is not saved; anything else missing is a different model.
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"{folder}: weights do not fit the model (missing {missing}, unexpected {unexpected})")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])


def token_logits(model: Any, ids: Any, attention: Any, where: Any) -> Any:
    """Logits predicting token i+1 at every position i where `where[:, i]` (shape ids[:, 1:]), as float.

    Only those positions go through the output layer: with a 2,048-token vocabulary and most of
    each sequence a prompt, the output layer and its softmax would otherwise cost more than
    the whole transformer body.
    """
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    return model.lm_head(hidden[where]).float()


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        _fsync_dir(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
