"""The reward curve as a PNG (matplotlib, imported here only: it is an extra, `gymrpc[train]`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def reward_curve(rows: Sequence[Mapping[str, Any]], out: Path, *, target: float | None = None) -> Path:
    """Mean batch reward per iteration, with the target as a dashed line; written to `out`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    iterations = [int(r["iteration"]) + 1 for r in rows]
    rewards = [float(r["reward"]) for r in rows]
    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    axes.plot(iterations, rewards, marker="o", label="mean reward of the batch")
    if target is not None:
        axes.axhline(target, linestyle="--", color="grey", label=f"target {target:g}")
    axes.set_xlabel("iteration")
    axes.set_ylabel("reward")
    axes.set_ylim(-0.02, 1.02)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    axes.set_title("GRPO on the counter task")
    figure.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    tmp.replace(out)
    return out
