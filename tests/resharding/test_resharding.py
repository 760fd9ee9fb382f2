"""Trainer -> sampler weight sync on two disjoint 4-device CPU meshes (8 forced host devices).

Trainer: the tiny MaxText Qwen3 with FSDP=4 on devices 0-3 (MaxText's own disaggregated split);
sampler: TP=4 on devices 4-7, shardings derived from the same logical axes. References are the
trainer's own arrays read back to NumPy and compared bit for bit.
"""

# pathwaysutils (the TPU extra) and vLLM are optional: the tests that use them import them where they run.
# pylint: disable=import-outside-toplevel
# pytest injects the `env` fixture by parameter name, which pylint reads as shadowing the fixture function.
# pylint: disable=redefined-outer-name

import concurrent.futures
import gc
import json
import sys
import types

from absl import logging as absl_logging
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.rollout import base_rollout

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import pathways
from maxtext_rl_plugin.run import models
from maxtext_rl_plugin.errors import ConfigError
from maxtext_rl_plugin.resharding import backend
from maxtext_rl_plugin.resharding import host_buffers
from maxtext_rl_plugin.resharding import move
from maxtext_rl_plugin.resharding import sync
from maxtext_rl_plugin.resharding import trees
from maxtext_rl_plugin.resharding import verify

pytestmark = pytest.mark.multidevice

TINY = "configs/cpu_tiny.yml"


def _bits(x) -> np.ndarray:
  a = np.asarray(x)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.fixture(scope="module")
def env(repo_root):
  """The trainer model on devices 0-3 (FSDP) and the sampler's TP shardings on devices 4-7."""
  if jax.device_count() < 8:
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

  rs = models.setup_devices(
      config_lib.parse(
          [str(repo_root / TINY), "use_pathways=true", "chips_per_vm=4", "ici_fsdp_parallelism=4", "vocab_size=1024"]
      )
  )
  assert rs.disaggregated and len(rs.trainer_devices) == 4 and len(rs.sampler_devices) == 4
  model, tmesh = models.build_model(rs.trainer_config, rs.trainer_devices, pad_id=0)
  # The sampler mesh: MaxText's axes, TP=4 instead of FSDP=4, on the sampler's devices.
  shape = {k: 1 for k in tmesh.axis_names}
  shape["tensor"] = 4
  smesh = Mesh(np.array(rs.sampler_devices).reshape([shape[k] for k in tmesh.axis_names]), tmesh.axis_names)
  state = nnx.state(model, nnx.Param)
  dst = trees.logical_shardings(state, smesh, rs.trainer_config.logical_axis_rules)
  return {"rs": rs, "model": model, "tmesh": tmesh, "smesh": smesh, "dst": dst, "config": rs.trainer_config}


def _state(model):
  return nnx.state(model, nnx.Param)


def _train_step(env, seed: int) -> float:
  """One real optimizer step on the trainer mesh (Adam on a next-token loss), jitted once per module."""
  if "step" not in env:
    env["opt"] = nnx.Optimizer(env["model"], optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
      def loss_fn(m):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, _ = m(tokens, positions, None, None)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    env["step"] = step
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, 8), 1, 1000)
  with env["tmesh"], nn.logical_axis_rules(env["config"].logical_axis_rules):
    return float(env["step"](env["model"], env["opt"], tokens))


def _perturb(model, scale: float) -> None:
  """New trainer weights without another compile (the real optimizer step is tested above)."""
  nnx.update(model, jax.tree.map(lambda x: x * scale + 0.25, _state(model)))


def _assert_bitwise_on(src, dst, dst_shardings, devices):
  s_leaves = jax.tree_util.tree_leaves_with_path(src)
  d_leaves = jax.tree.leaves(dst)
  e_leaves = jax.tree.leaves(dst_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert len(s_leaves) == len(d_leaves) == len(e_leaves) > 0
  for (path, a), b, e in zip(s_leaves, d_leaves, e_leaves):
    assert b.sharding.device_set == set(devices), jax.tree_util.keystr(path)
    assert b.sharding.is_equivalent_to(e, b.ndim), jax.tree_util.keystr(path)
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=jax.tree_util.keystr(path))


def test_layouts_really_differ(env):
  src = jax.tree.leaves(_state(env["model"]))
  dst = jax.tree.leaves(env["dst"], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert not set(src[0].sharding.device_set) & set(dst[0].device_set)
  differ = [a.sharding.spec != s.spec for a, s in zip(src, dst)]
  assert sum(differ) >= len(src) // 2  # FSDP vs TP: most weights change partitioning, not just devices


def test_sync_after_training_step_is_bitwise_on_sampler_mesh(env):
  before = [np.asarray(x).copy() for x in jax.tree.leaves(_state(env["model"]))]
  ws = sync.WeightSync(_settings(env), env["dst"], verify_policy="every_n", verify_every=1)
  first = ws.sync(_state(env["model"]))
  _train_step(env, seed=0)
  after = _state(env["model"])
  changed = [not np.array_equal(b, np.asarray(a)) for b, a in zip(before, jax.tree.leaves(after))]
  assert sum(changed) >= len(changed) - 1  # the step really moved the weights
  second = ws.sync(after, current=first)
  _assert_bitwise_on(after, second, env["dst"], env["rs"].sampler_devices)
  assert ws.num_syncs == 2 and ws.num_verified == 2
  assert ws.last_bytes == sum(x.nbytes for x in jax.tree.leaves(after)) and ws.last_seconds > 0
  assert ws.path == backend.PATH_DEVICE_PUT
  # reshard_donate (default true): the sampler's previous buffers were freed, the trainer's were not.
  assert all(x.is_deleted() for x in jax.tree.leaves(first))
  assert not any(x.is_deleted() for x in jax.tree.leaves(after))


def test_chunked_and_unchunked_agree(env):
  src = _state(env["model"])
  n = len(jax.tree.leaves(src))
  stats_all, stats_chunked = {}, {}
  whole = move.reshard(src, env["dst"], chunk_bytes=None, stats=stats_all)
  chunked = move.reshard(src, env["dst"], chunk_size=3, stats=stats_chunked)
  assert stats_all["chunks"] == 1 and stats_chunked["chunks"] == -(-n // 3)
  assert stats_chunked["max_chunk_bytes"] < stats_all["max_chunk_bytes"] == stats_all["bytes"]
  assert jax.tree.structure(whole) == jax.tree.structure(chunked) == jax.tree.structure(src)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(_bits(a), _bits(b))
  _assert_bitwise_on(src, chunked, env["dst"], env["rs"].sampler_devices)


def test_byte_chunks_bound_each_chunk_and_stay_bit_exact(env):
  """The device_put default chunks by bytes: every chunk within the budget unless one array alone exceeds it."""
  src = _state(env["model"])
  sizes = [x.nbytes for x in jax.tree.leaves(src)]
  limit = sorted(sizes)[len(sizes) // 2] * 2  # a budget that splits the tree and that the largest array exceeds
  stats = {}
  out = move.reshard(src, env["dst"], chunk_bytes=limit, stats=stats)
  assert 1 < stats["chunks"] < len(sizes)
  assert stats["max_chunk_bytes"] <= max(limit, *sizes)
  _assert_bitwise_on(src, out, env["dst"], env["rs"].sampler_devices)
  auto = {}
  move.reshard(src, env["dst"], stats=auto)  # 'auto': DEFAULT_CHUNK_BYTES on this (device_put) path
  assert auto["chunks"] == len(move.chunks_by_bytes(sizes, move.DEFAULT_CHUNK_BYTES))


def testchunks_by_bytes_partitions_in_order():
  sizes = [5, 1, 1, 9, 2, 2, 2, 20, 1]
  chunks = move.chunks_by_bytes(sizes, 6)
  assert [list(c) for c in chunks] == [[0, 1], [2], [3], [4, 5, 6], [7], [8]]
  assert [i for c in chunks for i in c] == list(range(len(sizes)))
  assert all(sum(sizes[i] for i in c) <= 6 or len(c) == 1 for c in chunks)
  assert move.chunks_by_bytes([], 6) == [range(0)]


def test_two_phase_device_put(env):
  """The GPU/TPU default without Pathways: re-partition on the trainer devices, then shard-for-shard copy."""
  src = _state(env["model"])
  staged = move.reshard(src, env["dst"], chunk_size=5, two_phase=True)
  _assert_bitwise_on(src, staged, env["dst"], env["rs"].sampler_devices)
  again = move.reshard(src, env["dst"], chunk_size=5, two_phase=True, release=staged)
  _assert_bitwise_on(src, again, env["dst"], env["rs"].sampler_devices)
  assert all(x.is_deleted() for x in jax.tree.leaves(staged))
  assert not any(x.is_deleted() for x in jax.tree.leaves(src))
  x = jax.tree.leaves(src)[1]
  target = jax.tree.leaves(env["dst"], is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[1]
  staging = move._staging_sharding(x, target)  # pylint: disable=protected-access  # the unit under test
  assert staging.device_set == x.sharding.device_set and staging.spec == target.spec != x.sharding.spec


def _replace_leaf(tree, index, new):
  leaves, treedef = jax.tree.flatten(tree)
  leaves[index] = new
  return jax.tree.unflatten(treedef, leaves)


@pytest.mark.parametrize("corruption", ["one_bit", "swap"])
def test_guard_catches_a_corrupted_array(env, corruption):
  src = _state(env["model"])
  dst = move.reshard(src, env["dst"])
  verify.verify(src, dst, dst_shardings=env["dst"])  # clean sync passes
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(src)]
  k = next(i for i, p in enumerate(paths) if "wi_0" in p)
  leaf = jax.tree.leaves(dst)[k]
  host = np.asarray(leaf).copy()
  flat = host.reshape(-1)
  if corruption == "one_bit":
    flat.view(np.uint32)[12345] ^= np.uint32(1)  # lowest mantissa bit of one element
  else:
    i, j = 7, 7 + host.shape[-1]  # two distinct elements of the same array trade places
    assert flat[i] != flat[j]
    flat[i], flat[j] = flat[j], flat[i].copy()
  bad = _replace_leaf(dst, k, jax.device_put(host, leaf.sharding))
  with pytest.raises(trees.WeightSyncError, match=r"wi_0.*1 of \d+ arrays differ"):
    verify.verify(src, bad)


def test_guard_catches_a_dropped_chunk(env, monkeypatch):
  ws = sync.WeightSync(
      _settings(env), env["dst"], chunk_size=4, release_old=False, verify_policy="every_n", verify_every=1
  )
  src = _state(env["model"])
  stale = move.reshard(jax.tree.map(lambda x: x * 0.5 + 1, src), env["dst"])  # the sampler's previous weights
  real_move = move._move  # pylint: disable=protected-access  # wrapped to record each chunk's call
  calls = []

  def lossy_move(arrays, shardings, **kw):  # the third chunk "arrives" with the sampler's old buffers
    calls.append(len(arrays))
    out = real_move(arrays, shardings, **kw)
    if len(calls) == 3:
      start = 4 * 2
      out = [jax.tree.leaves(stale)[start + i] for i in range(len(out))]
    return out

  monkeypatch.setattr(move, "_move", lossy_move)
  with pytest.raises(trees.WeightSyncError, match="differs from the trainer"):
    ws.sync(src, current=stale)
  assert calls[:3] == [4, 4, 4]


def test_guard_structure_and_dtype_mismatch(env):
  src = _state(env["model"])
  dst = move.reshard(src, env["dst"])
  leaves = jax.tree.leaves(dst)
  with pytest.raises(trees.WeightSyncError, match="bfloat16"):
    verify.verify(src, _replace_leaf(dst, 0, leaves[0].astype(jnp.bfloat16)))
  with pytest.raises(trees.WeightSyncError, match="trees differ"):
    verify.verify(src, leaves[:-1])
  wrong = jax.tree.map(
      lambda x: jax.sharding.NamedSharding(env["tmesh"], jax.P()),
      env["dst"],
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
  )
  with pytest.raises(trees.WeightSyncError, match="expected"):
    verify.verify(src, dst, dst_shardings=wrong)


def test_verify_policy_cadence(env, monkeypatch):
  src = _state(env["model"])
  seen = []
  real_verify = verify.verify
  monkeypatch.setattr(verify, "verify", lambda *a, **k: (seen.append(1), real_verify(*a, **k)))
  counts = {}
  for policy in ("off", "first", "every_n"):
    ws = sync.WeightSync(_settings(env), env["dst"], verify_policy=policy, verify_every=2, release_old=False)
    for _ in range(5):
      ws.sync(src)
    counts[policy] = ws.num_verified
  assert counts == {"off": 0, "first": 1, "every_n": 3}  # every_n: syncs 1, 2, 4
  assert len(seen) == 4
  with pytest.raises(ConfigError, match="verify_weight_sync"):
    sync.WeightSync(_settings(env), env["dst"], verify_policy="sometimes")


def test_config_keys_are_read(env, repo_root):
  cfg = config_lib.load_config(
      [
          str(repo_root / TINY),
          "rl.reshard_chunk_size=5",
          "reshard_donate=false",
          "rl.verify_weight_sync=every_n",
          "rl.verify_weight_sync_every=3",
      ]
  )
  ws = sync.WeightSync(sync.SyncSettings.from_config(cfg), env["dst"])
  assert (ws.chunk_size, ws.release_old, ws.verify_policy, ws.verify_every) == (5, False, "every_n", 3)


class _FakePluginExecutable:
  """Stands in for pathwaysutils.plugin_executable.PluginExecutable (the IFRT proxy program; raises on CPU)."""

  requests: list = []
  calls: list = []

  def __init__(self, prog_str: str):
    type(self).requests.append(json.loads(prog_str))

  def call(self, in_arr=(), out_shardings=(), out_avals=(), out_committed=True):
    type(self).calls.append((len(in_arr), tuple(out_shardings)))
    fut = concurrent.futures.Future()
    fut.set_result(None)
    return list(jax.device_put(list(in_arr), list(out_shardings))), fut


def _initialized_at_startup(monkeypatch):
  """What train_rl.main does first on Pathways (pathways.initialize); resharding no longer initialises late."""
  import pathwaysutils._initialize as pinit

  monkeypatch.setattr(pinit, "_initialization_count", 0)
  assert pathways.initialize()


def test_pathways_experimental_path_with_faked_plugin_program(env, monkeypatch):
  from pathwaysutils import plugin_executable
  from pathwaysutils.experimental import reshard as pw_experimental

  monkeypatch.setenv("JAX_PLATFORMS", "proxy")
  _initialized_at_startup(monkeypatch)
  monkeypatch.setattr(plugin_executable, "PluginExecutable", _FakePluginExecutable)
  monkeypatch.setattr(backend, "_logged_paths", set())
  pw_experimental._get_resharding_plan_cached.cache_clear()  # pylint: disable=protected-access  # test isolation
  _FakePluginExecutable.requests, _FakePluginExecutable.calls = [], []
  assert backend.backend_path() == backend.PATH_PATHWAYS_EXPERIMENTAL

  src = _state(env["model"])
  n = len(jax.tree.leaves(src))
  ws = sync.WeightSync(_settings(env), env["dst"], chunk_size=4, release_old=False, verify_policy="first")
  assert ws.path == backend.PATH_PATHWAYS_EXPERIMENTAL
  out = ws.sync(src)
  _assert_bitwise_on(src, out, env["dst"], env["rs"].sampler_devices)
  calls = _FakePluginExecutable.calls
  assert sum(c[0] for c in calls) == n and max(c[0] for c in calls) <= 4  # every array, chunks of <= 4
  assert len(calls) >= -(-n // 4)
  sampler_ids = sorted(d.id for d in env["rs"].sampler_devices)
  for req in _FakePluginExecutable.requests:
    r = req["reshardRequest"]
    assert r["donateInput"] is False
    assert all(sorted(o["devices"]["device_ids"]) == sampler_ids for o in r["outSharding"])
  expected = jax.tree.leaves(env["dst"], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  used = [s for c in calls for s in c[1]]
  assert all(any(u == e for e in expected) for u in used)
  # Plans are cached: a second sync of the same layout compiles no new reshard program.
  plans, first_calls = len(_FakePluginExecutable.requests), len(calls)
  ws.sync(src)
  assert len(_FakePluginExecutable.requests) == plans and len(calls) == 2 * first_calls


def test_pathways_stable_path_when_experimental_missing(env, monkeypatch):
  from pathwaysutils import reshard as pw_reshard

  monkeypatch.setenv("JAX_PLATFORMS", "proxy")
  _initialized_at_startup(monkeypatch)
  import pathwaysutils.experimental

  monkeypatch.setitem(sys.modules, "pathwaysutils.experimental.reshard", None)  # import raises ImportError
  monkeypatch.delattr(pathwaysutils.experimental, "reshard", raising=False)
  monkeypatch.setattr(backend, "_logged_paths", set())
  seen = []

  def fake_transfer(array_info, *, donate):  # the IFRT RemapArrays boundary (raises on CPU)
    seen.append((len(array_info["arrays"]), donate))
    return jax.device_put(array_info["arrays"], array_info["dst_shardings"])

  monkeypatch.setattr(pw_reshard, "_ifrt_jax_array_reshard", fake_transfer)
  assert backend.backend_path() == backend.PATH_PATHWAYS
  src = _state(env["model"])
  out = move.reshard(src, env["dst"], chunk_size=5)
  _assert_bitwise_on(src, out, env["dst"], env["rs"].sampler_devices)
  assert sum(s[0] for s in seen) == len(jax.tree.leaves(src)) and max(s[0] for s in seen) <= 5
  assert not any(s[1] for s in seen)


def test_device_put_path_logged_once(env, monkeypatch, caplog):
  monkeypatch.setattr(backend, "_logged_paths", set())
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  logged = []
  monkeypatch.setattr(absl_logging, "info", lambda msg, *a: logged.append(msg % a))
  assert backend.backend_path() == backend.PATH_DEVICE_PUT
  assert backend.backend_path() == backend.PATH_DEVICE_PUT
  assert [m for m in logged if "weight sync path" in m] == [
      "weight sync path: device_put (JAX_PLATFORMS has no 'proxy' (not a Pathways backend))"
  ]


def test_checksum_matches_numpy_reference_and_is_layout_independent(env):
  rng = np.random.default_rng(0)
  host = rng.standard_normal((4, 7, 5)).astype(np.float32)  # odd dims exercise the halving's carry
  words = host.view(np.uint32)

  def weights(n, axis):  # independent re-derivation with Python ints
    return [((i * 0x9E3779B1 + 0x7F4A7C15 * (2 * axis + 1)) | 1) % 2**32 for i in range(n)]

  w = [weights(n, a) for a, n in enumerate(host.shape)]
  ref = (
      sum(int(words[i, j, k]) * w[0][i] * w[1][j] * w[2][k] for i in range(4) for j in range(7) for k in range(5)) % 2**32
  )
  on_trainer = jax.device_put(host, jax.sharding.NamedSharding(env["tmesh"], jax.P("fsdp")))  # dim 0 split
  on_sampler = jax.device_put(host, jax.sharding.NamedSharding(env["smesh"], jax.P(None, None, None)))  # replicated
  got = verify.checksums([on_trainer, on_sampler, host, host[:, :, ::-1].copy()])
  assert int(got[0]) == int(got[1]) == int(got[2]) == ref
  assert int(got[3]) != ref  # same values, permuted


class _TinyRollout:
  """Minimal Tunix rollout engine: holds its own copy of the actor on the rollout mesh (what an engine must do)."""

  dst = None  # set by the test: sampler shardings (None: colocated engine)
  rules = None  # MaxText logical_axis_rules
  drop = None  # a parameter-path substring the "buggy" engine forgets to update

  @classmethod
  def make(cls):
    """A BaseRollout subclass whose model() is `cls`'s sampler module."""

    class Engine(base_rollout.BaseRollout):
      """The smallest engine Tunix's RLCluster accepts."""

      def __init__(self, rollout_actor, tokenizer, mesh, rollout_config):
        del tokenizer, rollout_config
        self.mesh = mesh
        if cls.dst is None:  # colocated: generate with the actor's own arrays
          self._model = rollout_actor
          return
        self._model = move.model_on_mesh(rollout_actor, mesh, cls.rules)

      def update_params(self, params, filter_types=None):
        if cls.drop:
          params = jax.tree_util.tree_map_with_path(
              lambda p, new, old: old if cls.drop in jax.tree_util.keystr(p) else new,
              params,
              nnx.state(self._model, nnx.Param),
          )
        nnx.update(self._model, params)

      def generate(self, prompts, rollout_config, **kwargs):
        raise NotImplementedError

      def get_per_token_logps(  # pylint: disable=arguments-differ  # Tunix's own engines take these
          self, prompt_tokens, completion_tokens, pad_id, eos_id, **kwargs
      ):
        raise NotImplementedError

      def pad_id(self):
        return 0

      def eos_id(self):
        return 0

      def model(self):
        return self._model

    return Engine


def _settings(env) -> sync.SyncSettings:
  """The sync settings of the env's config (cpu_tiny.yml: verify_weight_sync=first, reshard_donate=true)."""
  return sync.SyncSettings.from_config(env["config"])


def _rl_cluster(env, engine, colocated: bool = False):
  """A Tunix RLCluster over the env's trainer model and `engine` (disaggregated unless `colocated`)."""
  Role = rl_cluster_lib.Role
  cfg = rl_cluster_lib.ClusterConfig(
      role_to_mesh={
          Role.ACTOR: env["tmesh"],
          Role.REFERENCE: env["tmesh"],
          Role.ROLLOUT: env["tmesh"] if colocated else env["smesh"],
      },
      rollout_engine=engine,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=1000, max_steps=1
      ),
      rollout_config=base_rollout.RolloutConfig(),
  )
  return rl_cluster_lib.RLCluster(actor=env["model"], tokenizer=_NoTokenizer(), cluster_config=cfg)


class _NoTokenizer:
  """The tokenizer protocol Tunix checks for; weight sync never tokenizes."""

  def encode(self, text):
    raise NotImplementedError

  def decode(self, ids):
    raise NotImplementedError

  def bos_id(self):
    return 1

  def eos_id(self):
    return 0

  def pad_id(self):
    return 0


@pytest.mark.parametrize("buggy_engine,release", [(False, True), (True, True), (True, False)])
def test_rl_cluster_sync_weights_goes_through_the_plugin(env, buggy_engine, release):
  """Tunix's own RLCluster.sync_weights (transfer guards, anchor snapshot, step counter) with the hook installed."""
  _TinyRollout.dst, _TinyRollout.drop, _TinyRollout.rules = env["dst"], None, env["config"].logical_axis_rules
  cluster = _rl_cluster(env, _TinyRollout.make())
  assert cluster.rollout.model() is not cluster.actor_trainer.model
  held = _state(cluster.rollout.model())  # model_on_mesh: the engine's own copy, in the sampler layout
  _assert_bitwise_on(_state(cluster.actor_trainer.model), held, env["dst"], env["rs"].sampler_devices)
  if buggy_engine:
    ws = sync.WeightSync(_settings(env), release_old=release, verify_policy="every_n", verify_every=1)
    sync.install_into_rl_cluster(cluster, ws)
  else:  # the trainer's one call; cpu_tiny.yml: verify_weight_sync=first, reshard_donate=true
    ws = sync.attach_to_rl_cluster(cluster, _settings(env))
    assert ws is not None and ws.verify_policy == "first" and ws.release_old
  _perturb(cluster.actor_trainer.model, scale=1.5 + buggy_engine + release)  # new trainer weights, cheaply
  trainer = _state(cluster.actor_trainer.model)
  _TinyRollout.drop = "wo" if buggy_engine else None  # the engine forgets to install mlp/wo
  if buggy_engine:
    why = "released buffer" if release else "differs from the trainer"
    with pytest.raises(trees.WeightSyncError, match=r"\['wo'\].*" + why):
      cluster.sync_weights()
    return
  cluster.sync_weights()
  assert ws.num_syncs == 1 and ws.num_verified == 1 and cluster.global_steps == 1
  _assert_bitwise_on(trainer, _state(cluster.rollout.model()), env["dst"], env["rs"].sampler_devices)
  assert not any(x.is_deleted() for x in jax.tree.leaves(trainer))


def test_attach_is_a_no_op_when_colocated(env):
  _TinyRollout.dst, _TinyRollout.drop = None, None
  cluster = _rl_cluster(env, _TinyRollout.make(), colocated=True)
  assert sync.attach_to_rl_cluster(cluster, _settings(env)) is None
  assert cluster.rollout not in sync._INSTALLED  # pylint: disable=protected-access  # nothing wrapped


def test_weight_sync_destinations_mesh_rules_and_sampler_model(env):
  """The other two ways to name the destination: a sampler mesh + rules, or the sampler's nnx model."""
  src = _state(env["model"])
  by_mesh = sync.WeightSync(_settings(env), mesh=env["smesh"], rules=env["config"].logical_axis_rules)
  _assert_bitwise_on(src, by_mesh.sync(src), env["dst"], env["rs"].sampler_devices)

  sampler = move.model_on_mesh(env["model"], env["smesh"], env["config"].logical_axis_rules)
  old = jax.tree.leaves(_state(sampler))
  _perturb(env["model"], scale=0.5)
  src = _state(env["model"])
  ws = sync.WeightSync(_settings(env), sampler)  # updates the sampler model in place
  held = ws.sync(src)
  _assert_bitwise_on(src, _state(sampler), env["dst"], env["rs"].sampler_devices)
  _assert_bitwise_on(src, held, env["dst"], env["rs"].sampler_devices)
  assert ws.num_verified == 1 and all(x.is_deleted() for x in old)  # reshard_donate: old buffers released


@pytest.mark.parametrize(
    "policy,every,checked",
    [
        ("off", 10, []),
        ("first", 10, [1]),
        ("every_n", 10, [1, 10, 20]),  # the first sync, then every N-th (not 1, 11, 21)
        ("every_n", 1, list(range(1, 22))),
    ],
)
def test_verify_policy_is_one_schedule_for_every_engine(policy, every, checked):
  """verify.verify_due is the one schedule: the embedded engine's WeightSync and the vLLM engine both ask it."""
  from maxtext_rl_plugin.rollout import vllm as vllm_rollout  # pylint: disable=import-outside-toplevel

  assert [n for n in range(1, 22) if verify.verify_due(policy, every, n)] == checked
  ws = sync.WeightSync(None, None, verify_policy=policy, verify_every=every)
  engine = object.__new__(vllm_rollout.VllmRollout)
  # An engine without its heavy constructor: only its settings' sync policy is read.
  engine.settings = types.SimpleNamespace(sync=sync.SyncSettings(verify_policy=policy, verify_every=every))
  got_ws, got_vllm = [], []
  for n in range(1, 22):
    ws.num_syncs = n  # the sync just done
    engine._syncs = n - 1  # pylint: disable=protected-access  # the vLLM engine counts before the sync completes
    got_ws += [n] if ws._verify_due() else []  # pylint: disable=protected-access
    got_vllm += [n] if engine._should_verify() else []  # pylint: disable=protected-access
  assert got_ws == got_vllm == checked


def test_release_buffers_is_one_rule_for_every_engine():
  """The embedded sync and the vLLM sync free old sampler arrays through one function: an array sharing a buffer
  with anything kept survives (even as a different Array object), the rest are deleted."""
  kept = jnp.arange(8.0)
  alias = jax.device_put(kept, kept.sharding)  # same buffer, possibly another Array object
  stale = jnp.ones(8)
  move.release_buffers([alias, stale, "not an array"], keep=move.buffer_ids(kept))
  assert not kept.is_deleted() and not alias.is_deleted()
  assert stale.is_deleted()
  np.testing.assert_array_equal(np.asarray(kept), np.arange(8.0))


def _host_assembled(out) -> list:
  """The arrays of `out` that took the host-assembly path (their shards adopted from `host_buffers.HOST_BUFFERS`)."""
  pool = host_buffers.HOST_BUFFERS.addresses()
  return [x for x in jax.tree.leaves(out) if all(s.data.unsafe_buffer_pointer() in pool for s in x.addressable_shards)]


def test_a_live_sampler_array_is_never_overwritten_by_a_later_sync(env):
  """XLA:CPU adopts the assembled host buffers zero-copy, so a buffer may be refilled only once no array holds it:
  weights kept alive (a pinned rollout snapshot, `reshard_donate=false`) keep their values bit for bit through later
  syncs of other values, chunk by chunk. (The single reused scratch buffer this replaced failed it whenever that buffer
  happened to be 64-byte aligned: the next chunk overwrote the previous chunk's adopted shards.)"""
  src = _state(env["model"])
  want = [np.asarray(x).copy() for x in jax.tree.leaves(src)]
  kept = move.reshard(src, env["dst"], chunk_size=1)
  for k in range(3):
    other = jax.tree.map(lambda x, k=k: x * (2.0 + k) + 1.0, src)
    newest = move.reshard(other, env["dst"], chunk_size=1)
    _assert_bitwise_on(other, newest, env["dst"], env["rs"].sampler_devices)
  for w, x in zip(want, jax.tree.leaves(kept)):
    np.testing.assert_array_equal(w.view(np.uint8), _bits(x).view(np.uint8))


def test_released_buffers_are_refilled_in_place(env):
  """One copy per sync and no new pages: the sampler's new shards are the very host buffers its released arrays held,
  and a sync that keeps the old arrays gets new buffers instead (checked by buffer address)."""
  src = _state(env["model"])
  first = move.reshard(src, env["dst"])
  assembled = len(_host_assembled(first))
  assert assembled >= len(jax.tree.leaves(first)) // 2  # FSDP -> TP: most arrays take this path

  def ptrs(tree):
    return {s.data.unsafe_buffer_pointer() for x in _host_assembled(tree) for s in x.addressable_shards}

  old = ptrs(first)
  second = move.reshard(jax.tree.map(lambda x: x + 1.0, src), env["dst"], release=first)
  assert all(x.is_deleted() for x in jax.tree.leaves(first))
  assert ptrs(second) == old and len(_host_assembled(second)) == assembled
  third = move.reshard(src, env["dst"])  # `second` still alive: fresh buffers
  assert not ptrs(third) & ptrs(second)
  _assert_bitwise_on(src, third, env["dst"], env["rs"].sampler_devices)
  held = host_buffers.HOST_BUFFERS.held_bytes()
  del second, third
  gc.collect()
  assert 0 < host_buffers.HOST_BUFFERS.trim() <= held  # buffers of collected arrays are dropped, not kept forever


def test_host_buffer_pool_hands_out_only_unheld_buffers():
  pool = host_buffers._HostBuffers()  # pylint: disable=protected-access  # a private pool, not the module's
  a = pool.take(4096)
  assert a.ctypes.data % 64 == 0 and a.nbytes == 4096
  held = jax.device_put(a.view(np.float32), jax.devices()[0], may_alias=True)
  del a
  b = pool.take(4096)  # the first buffer is held by the array: a second one
  assert b.ctypes.data != held.addressable_shards[0].data.unsafe_buffer_pointer()
  b_ptr = b.ctypes.data
  del b
  assert pool.take(4096).ctypes.data == b_ptr  # released views free the buffer again
  held.delete()
  assert pool.trim() == 2 * 4096 and pool.held_bytes() == 0
