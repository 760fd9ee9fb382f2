"""The RL run, split by concern: build.py (once), resume.py (checkpoint state), step.py (one RL step)."""
