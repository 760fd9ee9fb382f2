"""The fixture run's reward (make.sh): 0, 1, 0, 1, ... by position, so every group of a random-init model is
informative and both steps' updates carry a policy gradient (synthetic-task rewards of such a model are all zero)."""


def alternating(prompts, completions, **kwargs):
  del prompts, kwargs
  return [float(i % 2) for i in range(len(completions))]
