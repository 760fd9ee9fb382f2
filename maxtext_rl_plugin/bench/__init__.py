"""Benchmarks: python -m maxtext_rl_plugin.bench {rewards,rollout,reshard}."""
