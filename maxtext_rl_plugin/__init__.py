"""maxtext-rl-plugin: GRPO/GSPO post-training for MaxText models on Tunix's RL engine."""

__version__ = "0.1.0"
