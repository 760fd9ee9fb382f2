"""Trees and shardings: flattening with parameter paths, the structure check, logical axes -> sampler shardings."""

from __future__ import annotations

from typing import Any, Sequence

from flax import nnx
import flax.linen as nn
import jax

PyTree = Any


class WeightSyncError(RuntimeError):
  """The sampler does not hold the weights the trainer sent (or the trees do not correspond)."""


def is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def flatten(tree: PyTree):
  """(paths, leaves, treedef) with Shardings as leaves."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharding)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat], treedef


def as_sharding(x) -> jax.sharding.Sharding:
  if is_sharding(x):
    return x
  if hasattr(x, "sharding"):
    return x.sharding
  raise TypeError(f"destination leaf of type {type(x).__name__} is neither a Sharding nor an array")


def check_same_structure(src_paths, src_def, dst_paths, dst_def, what: str) -> None:
  if src_def == dst_def:
    return
  for a, b in zip(src_paths, dst_paths):
    if a != b:
      raise WeightSyncError(f"{what}: trainer and sampler trees differ at '{a}' vs '{b}' (check the weight mapping)")
  longer = src_paths[len(dst_paths) :] or dst_paths[len(src_paths) :]
  raise WeightSyncError(
      f"{what}: trainer tree has {len(src_paths)} arrays, sampler tree {len(dst_paths)}"
      + (f" (first extra: '{longer[0]}')" if longer else "")
  )


def _fit_spec(spec: jax.sharding.PartitionSpec, shape: Sequence[int], mesh) -> jax.sharding.PartitionSpec:
  """Drop mesh axes that would not divide a dimension (e.g. TP=4 over 2 KV heads -> replicate that dim)."""
  out = []
  used: set[str] = set()
  for d, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    kept, size = [], 1
    for ax in axes:
      n = mesh.shape[ax]
      if n == 1 or ax in used or shape[d] % (size * n):
        continue
      kept.append(ax)
      size *= n
      used.add(ax)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return jax.sharding.PartitionSpec(*out)


def logical_shardings(state: PyTree, mesh: jax.sharding.Mesh, rules) -> PyTree:
  """NamedShardings on `mesh` for an nnx param state, from its logical axes and MaxText `logical_axis_rules`.

  This is how a sampler layout that differs from the trainer's (e.g. TP instead of FSDP) is derived from
  the same model definition; mesh axes that do not divide a dimension are dropped (replicated) so small
  models and odd head counts still shard.
  """

  logical = nnx.get_partition_spec(state)
  return _zip_shardings(state, nn.logical_to_mesh(logical, rules), mesh)


def _zip_shardings(state: PyTree, mesh_specs: PyTree, mesh) -> PyTree:
  leaves, treedef = jax.tree_util.tree_flatten(state)
  specs = jax.tree_util.tree_leaves(mesh_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None)
  if len(specs) != len(leaves):
    raise WeightSyncError(f"logical partition specs ({len(specs)}) do not match the state's arrays ({len(leaves)})")
  return jax.tree_util.tree_unflatten(
      treedef,
      [
          jax.sharding.NamedSharding(mesh, _fit_spec(s or jax.sharding.PartitionSpec(), x.shape, mesh))
          for x, s in zip(leaves, specs)
      ],
  )
