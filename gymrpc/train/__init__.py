"""A reference RL trainer driven through gymrpc: GRPO in plain PyTorch on the tiny model and the counter task.

It is a real program (`gymrpc train run`, `python -m gymrpc.train run`), small enough to read in
one sitting, and the worked example of `docs/training.md`: rollouts through
`gymrpc.rollouts.collect`, new weights pushed with `gymrpc.weights.update_weights` while the
next batch is already running, and joint checkpoints of the stack and the trainer that a
`--resume` on a fresh stack continues from.

Modules: `samples` (trajectories to token sequences, group advantages), `cursor` (the data
cursor), `state` (the trainer's part of a joint checkpoint), `policy` (the torch model, the loss,
the step), `loop` (the iteration), `warmstart` (the deliberately weak start), `plot`, `command`.
torch, transformers and matplotlib are imported only where they are used (`.venv-vllm`).
"""
