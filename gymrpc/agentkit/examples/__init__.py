"""Example agent functions for `gymrpc.agentkit` (served with `--entrypoint`)."""
