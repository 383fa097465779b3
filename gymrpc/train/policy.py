"""The trained policy in plain PyTorch: the GRPO loss, an optimizer step, weights out as safetensors.

The loss is a truncated importance-weighted policy gradient on generated tokens only, token-mean
over the batch (every trained token weighs the same, however long its episode):

    weight = min(exp(logp_trainer - logp_sampler), max_weight)     (a constant: no gradient)
    loss   = -mean over trained tokens of [weight * exp(logp - logp_trainer) * A - kl_beta * k3]
    k3     = exp(logp_ref - logp) - (logp_ref - logp) - 1            (>= 0, an estimate of KL(pi || pi_ref))

`logp_sampler` is what the model server sampled the token with; `logp_trainer` is the trainer's
weights at the start of the step, which are one version ahead when the next batch was already
running while the previous step was taken. The weight corrects for that lag. PPO's clipped
surrogate against `logp_sampler` does not: with one step per batch its ratio is already
pi_trainer / pi_sampler before the step, so every token the previous step moved by more than the
clip range (the few tokens that decide the reward) got no gradient at all. The decoupled form
(the proximal policy is the trainer's own weights) keeps the correction and the gradient.

`logp_ref` is a frozen copy of the start weights (`Hyper.kl_beta` > 0). Without it, one step
that moves the tool-call format's tokens (Adam moves every weight by about lr whatever its
gradient) could leave a policy whose every episode fails: no group differs, so the policy
gradient is zero from then on. The KL term is on every trained token, also of groups whose
rewards are all equal, so it is the one term that still pulls towards the start's format. Measured
(docs/training.md): with beta 0.02 the later batches drift less, the first reaching 0.9 comes later.

torch and transformers are imported inside the functions: they are in `.venv-vllm` only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gymrpc.durable import fsync_folder
from gymrpc.train.samples import Sample

WEIGHTS_FILES = ("model.safetensors", "config.json", "generation_config.json")
REFERENCE_DIR = "reference"


@dataclass(frozen=True)
class StepStats:
    loss: float
    trained_tokens: int
    clipped: float
    """Fraction of trained tokens whose importance weight was capped at `Hyper.max_weight`."""
    kl: float
    """Mean of logp_sampler - logp_trainer over trained tokens (an estimate of KL(sampler || trainer))."""
    grad_norm: float
    kl_ref: float = 0.0
    """Mean k3 estimate of KL(trainer || reference) over trained tokens (0 without a reference)."""


@dataclass(frozen=True)
class Hyper:
    lr: float = 3e-4
    """3e-3 wrecks the weak start in one step (Adam's first steps move every weight by about lr, the
    format's included); the documented runs use 6e-4 with 64 episodes a batch, where 16 a batch
    plateaued or collapsed (docs/training.md, the reference trainer's measured runs)."""
    max_weight: float = 2.0
    """Cap on the importance weight pi_trainer / pi_sampler of a token (truncated importance sampling)."""
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    """Sequences per forward/backward; the step is still one optimizer step over the whole batch."""
    kl_beta: float = 0.0
    """Weight of the k3 KL penalty towards the start weights (0: no reference model is kept)."""


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
        self.reference: Any = None
        if hyper.kl_beta > 0:
            self.reference = _frozen_copy(self.model)

    def step(self, samples: Sequence[Sample]) -> StepStats:
        """One optimizer step on `samples` (advantages set); advantage-0 samples only count tokens, unless a KL term."""
        import torch

        rows = [(seq, s.advantage) for s in samples for seq in s.sequences if seq.trained_tokens]
        total = sum(seq.trained_tokens for seq, _ in rows)
        if total == 0:
            return StepStats(0.0, 0, 0.0, 0.0, 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = kl = kl_ref = 0.0
        stepped = False
        for start in range(0, len(rows), self.hyper.micro_batch):
            chunk = rows[start : start + self.hyper.micro_batch]
            if self.reference is None and all(a == 0.0 for _, a in chunk):
                continue  # no gradient; their tokens still count in `total`
            loss, n_clipped, kl_sum, ref_sum = self._loss(chunk)
            (loss / total).backward()
            stepped = True
            loss_sum += float(loss.detach())
            clipped += n_clipped
            kl += kl_sum
            kl_ref += ref_sum
        norm = 0.0
        if stepped:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper.max_grad_norm))
            self.optimizer.step()
        return StepStats(loss_sum / total, total, clipped / total, kl / total, norm, kl_ref / total)

    def _loss(self, chunk: Sequence[tuple[Any, float]]) -> tuple[Any, int, float, float]:
        """Summed (not averaged) loss of `chunk`, count of capped weights, summed KL estimates (sampler, reference)."""
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
        prox = new.detach()  # the weights this step starts from
        behaviour = old[:, 1:][where]
        behaviour = torch.where(torch.isnan(behaviour), prox, behaviour)  # no sampled logprob: on-policy
        adv = advantage.expand(-1, where.shape[1])[where]
        weight = torch.exp(prox - behaviour)
        capped = weight > self.hyper.max_weight
        surrogate = weight.clamp(max=self.hyper.max_weight) * torch.exp(new - prox) * adv
        loss = -surrogate.sum()
        ref_sum = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = token_logits(self.reference, ids, attention, where)
                ref = ref_logits.log_softmax(-1).gather(-1, ids[:, 1:][where].unsqueeze(-1)).squeeze(-1)
            k3 = torch.exp(ref - new) - (ref - new) - 1
            loss = loss + self.hyper.kl_beta * k3.sum()
            ref_sum = float(k3.detach().sum())
        return loss, int(capped.sum()), float((behaviour - prox).sum()), ref_sum

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
        fsync_folder(folder.parent)
        return folder

    def save_state(self, folder: Path) -> None:
        """Weights, optimizer, torch RNG (and the KL reference, so a resume needs no start folder) into `folder`."""
        import torch

        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder / "weights", safe_serialization=True)
        if self.reference is not None:
            self.reference.save_pretrained(folder / REFERENCE_DIR, safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}, folder / "optimizer.pt")
        _fsync_tree(folder)

    def load_state(self, folder: Path) -> None:
        """The reverse of `save_state` (the weights are loaded in place, the optimizer keeps its moments)."""
        import torch

        _load_weights(self.model, folder / "weights")
        if self.reference is not None:
            if not (folder / REFERENCE_DIR).is_dir():
                from gymrpc.train.state import StateError

                raise StateError(f"{folder}: no {REFERENCE_DIR}/ (saved without a KL penalty): resume with --kl-beta 0")
            _load_weights(self.reference, folder / REFERENCE_DIR)
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])


def _frozen_copy(model: Any) -> Any:
    import copy

    frozen = copy.deepcopy(model)
    frozen.eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen


def _load_weights(model: Any, folder: Path) -> None:
    """`folder/model.safetensors` into `model` in place; a tied lm_head may be absent, nothing else."""
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not fit the model (missing {missing}, unexpected {unexpected})")
    if model.config.tie_word_embeddings:
        model.tie_weights()


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
        fsync_folder(path)
