"""The agent role: runs episodes (seed, model and tool calls, verify) as an explicit state machine.

`state` holds one episode's `EpisodeState` (what a checkpoint will store), `loop` moves it
from boundary to boundary by calling injected resources and model stubs, and `service`
serves `gymrpc.v1.AgentService` on top of both.
"""
