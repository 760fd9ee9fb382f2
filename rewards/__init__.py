"""GSM8K reward functions, answer extraction and the offline scoring CLI."""
