"""What the algorithm modules share: the check of a string choice and the log-ratio guard (see __init__)."""

# Log-ratios and KL log-differences are clamped to +-LOG_RATIO_CLAMP (ratios within [2e-9, 4.9e8]).
LOG_RATIO_CLAMP = 20.0


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
  """ValueError naming `name` unless `value` is one of `choices` (library-level: configs are refused earlier)."""
  if value not in choices:
    raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
