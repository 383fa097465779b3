"""Test support that needs more than the runtime: tiny local models for the real-vLLM tier.

Importing this package is cheap; torch and transformers are imported only by the
functions that build or train a model (they exist in `.venv-vllm`, not in `.venv`).
"""
