"""Cluster launchers: XPK create-pathways (Pathways on GKE) and Ray Train's JaxTrainer (KubeRay).

Both build what a user of the engine would type by hand, after validating it on the submitting machine:
`python -m maxtext_rl_plugin.launch {xpk,xpk-delete,xpk-list,ray} ... -- <train_rl key=value overrides>`.
`xpk.py` builds xpk command lines, `ray.py` builds the JaxTrainer and the per-worker entry, `smoke.py` is the
multi-process GRPO step used to check a cluster. See docs/tutorial.md and docs/architecture.md.
"""
