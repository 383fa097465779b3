"""The model role: `gymrpc.v1.ModelService` over pluggable backends (scripted, OpenAI upstream, vLLM)."""
