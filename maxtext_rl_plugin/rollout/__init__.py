"""Rollout engines: the embedded JAX KV-cache engine and the vLLM-TPU adapter."""
