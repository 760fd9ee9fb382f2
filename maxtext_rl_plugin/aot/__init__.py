"""Ahead-of-time compilation of the RL step for a TPU topology (`compile_topology`): topology.py (the target's
devices and published figures), programs.py (the step's programs, built abstractly from the run's own functions),
compile.py (lower, compile, OOM as a verdict), report.py (the table, the fit verdict, the step estimate), run.py;
anchor_tunix.py (Tunix's own GRPO loss step beside the plugin's update)."""
