"""A reward that varies between completions of a random-init model (whose GSM8K rewards are all zero), so the
multi-process tests compare a non-zero policy loss: the share of ASCII letters and digits among the characters."""


def alnum_share(prompts, completions, **kwargs):
  del prompts, kwargs
  return [sum(ch.isascii() and ch.isalnum() for ch in c) / max(1, len(c)) for c in completions]
