"""Multi-turn episodes with tools inside the plugin's own RL loop (`rl.use_agentic_rollout`, docs/agentic.md).

`tools.py` runs the tool set (Tunix's `ToolManager` / `CalculatorTool`) with a timeout and error observations;
`parse.py` finds a turn's tool call with Tunix's tool-call parser; `episode.py` is the turn loop over a rollout
engine and the per-token loss mask that keeps the environment's tokens out of the loss.
"""
