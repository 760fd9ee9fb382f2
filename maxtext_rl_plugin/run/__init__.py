"""The RL run, split by concern: `loop.py` (the loop and `run`, the entry point below `train_rl`), `state.py` (what a
run holds), `build.py` (once, with `models.py`: MaxText's builders, which take the whole config, and `warm_start.py`:
the optional SFT warm start), `resume.py` (checkpoint state), `step.py` (one RL step), and the rooms a step uses:
`experience.py` (one rollout batch), `dynamic_sampling.py` (DAPO's refills), `async_rollout.py` (the producer ahead
of the trainer), `updates.py` (the update plan's rows), `evaluation.py` (MaxText's eval) and `summary.py` (the end of
a run). `meta.py` holds the counts and resume rules every checkpoint records; light, so the first pass reads it too.
Imports point one way: the loop reads build, resume and step; build and step read state; resume reads meta and state."""
