"""Gradient accumulation inside one jitted update (accumulation.py) against Tunix's `optax.MultiSteps` path.

The reference is the code path the run took before: Tunix's own train-step body (`PeftTrainer._train_step`, through
`tunix_compat.actor_train_step`) called once per micro-batch on an `nnx.Optimizer` wrapped in `optax.MultiSteps`, as
`PeftTrainer` wraps it when `train_micro_batch_size` is set. Both run the registry's policy loss on the same real tiny
MaxText model; the parameters after every update must agree to float32 round-off, with 1, 2 and 4 micro-batches per
update, two updates in a row (the second sees moved weights, as with rl.num_iterations=2), full fine-tuning and LoRA.
The optimizer is made nearly linear in the gradient (adam_eps=1000, as tests/run/test_trainer_updates.py does), so a wrong
scale (a sum instead of a mean over micro-batches) cannot hide behind Adam's scale invariance.
"""

import dataclasses
import pathlib
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from tunix.rl.grpo import grpo_learner

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.run import accumulation
from maxtext_rl_plugin.run import models as run_models
from maxtext_rl_plugin import tunix_compat
from maxtext_rl_plugin.run import updates
from maxtext_rl_plugin.aot import programs
from maxtext_rl_plugin.run import build

import _in_process as in_process

# The CPU demo's tokenizer (528 tokens) under an even smaller cpu_tiny model: a real MaxText model in seconds.
SMALL = [
    "configs/cpu_tiny.yml",
    "tokenizer_path=tokenizers/arith-bpe-512",
    "vocab_size=528",
    "use_chat_template=false",
    "data_template_path=cpu_demo_template.json",
    "base_emb_dim=32",
    "base_mlp_dim=64",
    "base_num_decoder_layers=1",
    "max_prefill_predict_length=8",
    "max_target_length=20",
    "batch_size=4",
    "gradient_clipping_threshold=0",
    "adam_eps=1000",
    "adam_weight_decay=0",
    "learning_rate=30",
    "warmup_steps_fraction=0",
]
LORA = ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"]


def _example(config, seed: int) -> grpo_learner.TrainExample:
  """A rollout batch of batch_size x G rows with ragged completions (so token-mean micro-batches differ in size)."""
  rng = np.random.default_rng(seed)
  rows = int(config.batch_size) * int(config.rl.num_generations)
  p, t = int(config.max_prefill_predict_length), int(config.max_target_length - config.max_prefill_predict_length)
  lengths = rng.integers(1, t + 1, rows)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
  completion = np.where(mask, rng.integers(2, 500, (rows, t)), 0).astype(np.int32)
  return grpo_learner.TrainExample(
      prompt_ids=jnp.asarray(rng.integers(2, 500, (rows, p)), jnp.int32),
      prompt_mask=jnp.ones((rows, p), jnp.int32),
      completion_ids=jnp.asarray(completion),
      completion_mask=jnp.asarray(mask),
      advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
      ref_per_token_logps=jnp.asarray(-rng.uniform(1, 8, (rows, t)), jnp.float32),
      old_per_token_logps=jnp.asarray(-rng.uniform(1, 8, (rows, t)), jnp.float32),
  )


def _actor(config, devices, lora: bool):
  model, mesh = run_models.build_model(config, devices, pad_id=0)
  if lora:
    model, _ = run_models.apply_lora(config, model, mesh, 0)
  return model, mesh


def _leaves(model, lora: bool) -> dict[str, np.ndarray]:
  state = nnx.state(model, nnx.LoRAParam if lora else nnx.Param)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}


def _compare(argv, lora: bool):
  """Two updates over one batch on the MultiSteps path and on accumulation.train_step; returns the max relative
  parameter difference of each update, the parameter change of the first, and both paths' losses."""
  rs = run_models.setup_devices(config_lib.parse(argv))
  config = rs.trainer_config
  plan = updates.UpdatePlan.from_config(config)
  loss_fn, algo = programs.loss_fn_of(config)

  def gen_input(x):
    return {"train_example": x, "algo_config": algo}

  wrt = nnx.LoRAParam if lora else nnx.Param
  old_model, mesh = _actor(config, rs.trainer_devices, lora)
  new_model, _ = _actor(config, rs.trainer_devices, lora)
  init = _leaves(old_model, lora)
  with jax.set_mesh(mesh):
    old_opt = nnx.Optimizer(old_model, optax.MultiSteps(build.build_optimizer(config), plan.accumulation_steps), wrt=wrt)
    new_opt = nnx.Optimizer(new_model, build.build_optimizer(config), wrt=wrt)

    @nnx.jit
    def old_step(model, optimizer, micro):
      return tunix_compat.actor_train_step(model, optimizer, micro, loss_fn, gen_input, lora)

    @nnx.jit
    def new_step(model, optimizer, mini):
      return accumulation.train_step(
          model,
          optimizer,
          mini,
          loss_fn=loss_fn,
          gen_model_input_fn=gen_input,
          lora=lora,
          steps=plan.accumulation_steps,
      )

    example = _example(config, 0)
    micro = updates.micro_batches(example, plan)
    minis = updates.update_batches(example, plan)
    assert len(minis) == plan.updates_per_step and len(micro) == plan.micro_steps_per_step
    diffs, moves, old_losses, new_losses = [], [], [], []
    k = plan.accumulation_steps
    for u, mini in enumerate(minis):
      losses = [float(old_step(old_model, old_opt, m)[0]) for m in micro[u * k : (u + 1) * k]]
      old_losses.append(float(np.mean(losses)))
      new_losses.append(float(new_step(new_model, new_opt, mini)[0]))
      old, new = _leaves(old_model, lora), _leaves(new_model, lora)
      moves.append(max(np.abs(old[n] - init[n]).max() for n in old))
      diffs.append(max(np.abs(old[n] - new[n]).max() for n in old) / moves[-1])
  return diffs, moves[0], old_losses, new_losses


@pytest.mark.parametrize(
    "micro,extra",
    [
        (4, []),  # one micro-batch per update: no accumulator at all
        pytest.param(2, [], marks=pytest.mark.extended),  # 2 micro-batches: the scan of the 4 below, shorter
        (1, ["rl.loss_agg_mode=token-mean"]),  # 4 ragged micro-batches, each normalised by its own tokens
    ],
)
def test_accumulated_update_equals_multisteps(micro, extra):
  diffs, moved, old_losses, new_losses = _compare(
      [*SMALL, f"train_micro_batch_size={micro}", "rl.num_iterations=2", *extra], lora=False
  )
  assert moved > 1e-3  # the update moved the weights: the comparison is not vacuous
  assert max(diffs) < 1e-4, diffs
  np.testing.assert_allclose(new_losses, old_losses, rtol=1e-5, atol=1e-6)


def test_accumulated_lora_update_equals_multisteps():
  diffs, moved, old_losses, new_losses = _compare(
      [*SMALL, *LORA, "train_micro_batch_size=1", "rl.num_iterations=2"], lora=True
  )
  assert moved > 1e-3
  # Relative to the move: 2.4e-4 on this project's Nov 29 host (AMD EPYC; under 1e-4 on earlier hosts): the adapters'
  # round-off differs with the CPU's XLA kernels and AdamW scales it up. A dropped or mis-scaled micro-batch moves
  # them by 0.1-1 of the step, so 1e-3 still tells the two apart by 100x; the losses below stay at 1e-5.
  assert max(diffs) < 1e-3, diffs
  np.testing.assert_allclose(new_losses, old_losses, rtol=1e-5, atol=1e-6)


def test_update_batches_give_back_the_micro_batches():
  """The strided order of update_batches + MaxText's strided split (accumulation.split_micro_batches) = the
  contiguous micro-batches, each row exactly once (NumPy reference: the rows' own ids)."""

  @dataclasses.dataclass(frozen=True)
  class Rows:
    ids: np.ndarray
    other: None = None

  class Cfg:
    batch_size, train_micro_batch_size = 8, 2
    rl = type(
        "RL",
        (),
        {
            "mini_batch_size": 4,
            "num_iterations": 2,
            "num_generations": 3,
            "force_on_policy_ratio": False,
            "off_policy_steps": 0,
            "use_rollout_logps": False,
        },
    )()

  plan = updates.UpdatePlan.from_config(Cfg())
  ids = np.arange(24 * 5).reshape(24, 5)  # 8 prompts x 3 generations, 5 tokens each
  minis = updates.update_batches(Rows(ids), plan)
  assert len(minis) == plan.updates_per_step == 4
  micro = [m.ids for m in updates.micro_batches(Rows(ids), plan)]
  split = [np.asarray(accumulation.split_micro_batches(jnp.asarray(m.ids), plan.accumulation_steps)) for m in minis]
  got = [s[i] for s in split for i in range(plan.accumulation_steps)]
  assert len(got) == len(micro) == 8
  for g, want in zip(got, micro):
    np.testing.assert_array_equal(g, want)
  np.testing.assert_array_equal(micro[0], ids[:6])  # the reference itself: contiguous prompt groups


FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "data" / "legacy_multisteps"


def _tree(step_dir: pathlib.Path) -> dict[str, np.ndarray]:
  tree = ocp.StandardCheckpointer().restore(step_dir)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _nbytes(tree: dict[str, np.ndarray]) -> int:
  return sum(v.nbytes for v in tree.values())


def test_checkpoint_with_multisteps_state_resumes(tmp_path):
  """A checkpoint the plugin wrote before this change (tests/data/legacy_multisteps: step 1 of a 2-step run with 2
  micro-batches per update and rl.num_iterations=2, Tunix's MultiSteps optimizer state; make.sh says how) resumes, and
  step 2 lands where the uninterrupted old run's step 2 did (its params are in the fixture)."""
  run = tmp_path / "legacy_multisteps"
  shutil.copytree(FIXTURE / "checkpoints" / "1", run / "checkpoints" / "1")
  args = (FIXTURE / "args.txt").read_text().split()
  p = in_process.train_rl(
      [
          *args,
          f"reward_functions_path={FIXTURE / 'rewards.py'}",
          "reward_functions=alternating",
          f"base_output_directory={tmp_path}",
          "run_name=legacy_multisteps",
      ]
  )
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
  assert "from checkpoint step 1" in p.stdout
  step1, want = _tree(run / "checkpoints" / "1" / "params"), _tree(FIXTURE / "step2_params")
  got = _tree(run / "checkpoints" / "2" / "params")
  moved = max(np.abs(want[k] - step1[k]).max() for k in want)
  assert moved > 1e-3  # step 2 moved the weights (learning_rate=0.01): the comparison is not vacuous
  # Equal to round-off: the accumulated gradient is summed in another program than MultiSteps' (the scan), and AdamW
  # (eps 1e-8) scales round-off-sized gradient entries up to a visible step (measured: 5e-6 against a 2.7e-3 step on
  # the host that wrote the fixture, 1.3e-4 on this project's Nov 29 host, an AMD EPYC whose XLA CPU kernels round
  # otherwise); a lost or wrongly mapped AdamW state moves step 2 by an amount of the order of the step itself.
  assert max(np.abs(want[k] - got[k]).max() for k in want) <= 0.1 * moved
  # The new checkpoint has no accumulator: its optimizer state is the old one's without a params-sized tree.
  new_opt = _tree(run / "checkpoints" / "2" / "opt_state")
  assert not any("acc_grads" in k or "inner_opt_state" in k for k in new_opt)
  old_opt = _tree(FIXTURE / "checkpoints" / "1" / "opt_state")
  assert len(old_opt) - len(new_opt) == len(want) + 2  # acc_grads (one per param), mini_step, gradient_step
  assert _nbytes(old_opt) - _nbytes(new_opt) == _nbytes(want) + 8  # a float32 params copy and two int32 counters
