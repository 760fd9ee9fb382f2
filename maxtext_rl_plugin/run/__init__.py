"""The RL run, split by concern: state.py (what a run holds), build.py (once), resume.py (checkpoint state),
step.py (one RL step). Imports point one way: build and step read state; resume reads build and state."""
