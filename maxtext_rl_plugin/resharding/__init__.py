"""Trainer -> sampler weight sync: Pathways resharding or `jax.device_put`, chunked, with a correctness guard.

In disaggregated RL the trainer owns one device set (e.g. FSDP over half the chips) and the sampler another (e.g.
tensor parallel over the other half). After every optimizer step the new weights move from the trainer layout to the
sampler layout. This package is the one place that does it, one concern a module:

* `backend.py`: which path moves arrays (Pathways' reshard with an intermediate sharding, or `jax.device_put`),
  logged once, never chosen silently;
* `host_buffers.py`: on CPU, destination shards assembled from the source shards into pooled host buffers that
  XLA adopts zero-copy;
* `move.py`: `reshard`, chunk by chunk, the sampler's old buffers of a chunk freed before its new ones land;
* `per_host.py`: a multi-controller run's sync into one engine per host (relayout onto a (hosts, local) mesh, each
  host's own shards adopted) and its guard, which names the host;
* `verify.py`: the guard (`rl.verify_weight_sync`): per-array on-device checksums compared on the host;
* `trees.py`: flattening with parameter paths, the structure check, logical axes -> sampler shardings;
* `sync.py`: `WeightSync` (reshard, install, verify per policy) and its hook into Tunix's `RLCluster`.
"""
