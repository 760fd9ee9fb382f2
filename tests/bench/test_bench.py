"""The benchmark entry points run at tiny sizes and end with the JSON keys the docs quote."""

import json

import numpy as np
import pytest

from maxtext_rl_plugin.bench import __main__ as bench_main
from maxtext_rl_plugin.bench import peak
from maxtext_rl_plugin.bench import rollout as rollout_bench
from maxtext_rl_plugin.bench import step as bench_step


class _Cfg:
  emb_dim, num_query_heads, num_kv_heads, head_dim, mlp_dim, num_decoder_layers, vocab_size = 8, 4, 2, 4, 16, 3, 100


def test_decode_flops_matches_a_per_step_sum():
  """2 x (decoder + head params) per token plus QK^T/AV over each step's real context, summed step by step."""
  c = _Cfg()
  per_layer = 8 * 4 * 4 * 2 + 8 * 2 * 4 * 2 + 3 * 8 * 16
  params = 3 * per_layer + 8 * 100
  assert peak.param_counts(c)["total"] == params
  B, lp, T = 5, 7, 6
  expected = sum(B * (2 * params + 2 * 2 * 3 * 4 * 4 * (lp + t)) for t in range(T))
  assert peak.decode_flops(c, B, lp, T) == expected


def test_peak_is_positive_and_timed():
  r = peak.measure_peak_flops(n=128, repeats=2)
  assert r["peak_flops"] > 0 and r["peak_seconds"] > 0 and r["peak_matmul_n"] == 128


@pytest.mark.extended  # a benchmark's harness
def test_bench_rollout_tiny_emits_tunix_and_roofline_keys(capsys):
  """One batch of 1, 4 tokens: the engine and Tunix's Sampler (same weights) must agree token for token."""
  rc = bench_main.main(
      [
          "rollout",
          "--batch-sizes",
          "1",
          "--new-tokens",
          "4",
          "--repeats",
          "1",
          "--recompute-max-batch",
          "0",
          "--peak-n",
          "128",
      ]
  )
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  for key in (
      "peak_flops",
      "engine_fraction_of_peak_by_batch",
      "tunix_tokens_per_s_by_batch",
      "speedup_vs_tunix_by_batch",
      "tunix_greedy_match",
      "tunix_maxtext_error",
  ):
    assert key in out, key
  assert out["tunix_greedy_match"] is True
  assert out["greedy_match"] is True
  forced = out["by_batch"][0]["tunix_teacher_forced"]
  assert forced["positions"] == 4 and forced["argmax_disagreements"] == 0 and forced["identical_up_to_ties"] is True
  assert "attention_mask" in out["tunix_maxtext_error"]  # the adapter's exact refusal, recorded
  assert 0 < out["engine_fraction_of_peak_by_batch"]["1"] < 1
  assert np.isfinite(out["speedup_vs_tunix_by_batch"]["1"])


@pytest.mark.extended  # a benchmark's harness
def test_bench_step_tiny_reports_every_phase_and_totals_add_up(capsys):
  """One step of each loop (colocated, tiny batch): the JSON has every phase for both, and phases + overhead = total."""
  rc = bench_main.main(
      [
          "step",
          "--colocated",
          "--steps",
          "1",
          "--warmup",
          "0",
          "batch_size=4",
          "rl.num_generations=2",
          "max_target_length=136",
      ]
  )
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["bench"] == "step" and out["warm_steps"] == 1
  for side in ("plugin_s", "tunix_s"):
    row = out[side]
    assert set(row) == {"rollout", "reward", "logps", "update", "sync", "overhead", "total"}
    assert row["rollout"] > 0 and row["update"] > 0 and row["total"] > 0
    assert abs(sum(v for k, v in row.items() if k != "total") - row["total"]) < 1e-3
  assert set(out["plugin_over_tunix"]) == set(out["plugin_s"])
  # Roofline: both loops did the same work (same batches, same shapes), a fraction of the in-run peak each.
  assert out["flops"]["plugin"] == out["flops"]["tunix"] and min(out["flops"]["plugin"].values()) > 0
  for side in ("plugin", "tunix"):
    assert all(0 < f < 1 for f in out["fraction_of_peak"][side].values()), out["fraction_of_peak"]
  assert set(out["phase_medians_plugin_over_tunix"]) == {"rollout", "reward", "logps", "update", "sync", "total"}


class _StepCfg(_Cfg):
  max_prefill_predict_length, max_target_length = 16, 24

  class rl:  # pylint: disable=invalid-name  # MaxText's config attribute name
    num_iterations = 2


@pytest.mark.extended  # a benchmark's harness
def test_bench_moe_float32_sampler_routes_as_the_trainer_and_replay_is_measured(capsys):
  """The tiny Mixtral with both sides in float32: the cached decode and the full forward choose the same experts for
  every (token, layer), so the routing mismatch is exactly 0 and replay's log-probs agree with the sampler's."""
  rc = bench_main.main(
      ["moe", "--sampler-dtype", "float32", "--router-scales", "1", "--prompts", "2", "--generations", "2"]
      + ["--new-tokens", "6"]
  )
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["bench"] == "moe" and out["model"] == "mixtral-8x7b" and out["sampler_dtype"] == "float32"
  (row,) = out["rows"]
  assert row["router_scale"] == 1.0 and 0 < row["tokens"] <= 2 * 2 * 6
  assert row["routing_mismatch"] == 0.0
  for side in ("free", "replay"):
    assert row[side]["mismatch/logp_abs_diff_max"] < 1e-4 and abs(row[side]["mismatch/kl_k3"]) < 1e-8, side
    # the parity gate's figures and verdict at float32/float32's tolerances; the policy ratio is 1 to float32
    assert row[side]["parity/logp_abs_diff_max"] == row[side]["mismatch/logp_abs_diff_max"] and row[side]["gate"] == "ok"
    assert row[side]["ratio_std"] < 1e-4 and abs(row[side]["ratio_max"] - 1.0) < 1e-4
  assert out["trainer_dtype"] == "float32" and row["free"]["parity/routing_mismatch_fraction"] == 0.0


@pytest.mark.extended  # a benchmark's harness
def test_bench_agentic_times_a_turn_and_its_prefill_per_context_length(capsys):
  rc = bench_main.main(["agentic", "--contexts", "16,40", "--batch", "2", "--new-tokens", "4", "--repeats", "1"])
  assert rc == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["bench"] == "agentic" and [(r["L"], r["B"], r["T"]) for r in out["rows"]] == [(16, 2, 4), (40, 2, 4)]
  for r in out["rows"]:
    assert r["turn_s"] > 0 and r["prefill_1_s"] > 0 and r["prefill_share"] == r["prefill_1_s"] / r["turn_s"]


def test_step_flops_are_prefill_decode_forward_and_three_pass_update():
  c = _StepCfg()
  rows, seq = 6, 20
  counts = {"rows": rows, "generated_tokens": rows * 5, "logps_tokens": 2 * rows * seq, "seq_len": seq}
  f = bench_step.step_flops(c, counts)
  forward = peak.train_flops(c, rows * seq, seq, passes=1)  # one forward over every row's scored sequence
  assert f["logps"] == 2 * forward  # two log-prob passes (reference and old policy)
  assert f["update"] == 3 * 2 * forward  # forward + backward, rl.num_iterations = 2 times
  assert f["rollout"] == peak.train_flops(c, rows * 16, 16, passes=1) + peak.decode_flops(c, rows, 16, 5)


@pytest.mark.extended  # a benchmark's harness
def test_teacher_forced_check_tells_a_tie_from_a_wrong_model():
  """The Tunix copy of the engine's model agrees on the engine's own greedy tokens; a 5% change to one Tunix weight
  is not a float tie, and the verdict says so."""
  args = rollout_bench._parse_args(["--batch-sizes", "2"])  # pylint: disable=protected-access  # the bench's own build
  cfg, tok, model, mesh, engine = rollout_bench._build(args)  # pylint: disable=protected-access
  tmodel = rollout_bench.tunix_qwen3_like(model, cfg)
  prompts = [tok.encode("What is 17 * 23?"), tok.encode("Solve for x: 3x + 5 = 20.")]
  res = engine.generate_tokens(prompts, greedy=True, max_new_tokens=8, ignore_stop=True)
  same = rollout_bench.teacher_forced_agreement(model, tmodel, cfg, mesh, prompts, res.tokens)
  assert same["positions"] == 16 and same["identical_up_to_ties"] is True
  assert same["max_abs_logit_diff"] <= rollout_bench.FLOAT_TIE_RTOL * same["max_abs_logit"]
  down = tmodel.layers[0].mlp.down_proj.kernel
  down.value = down.value * 1.05
  wrong = rollout_bench.teacher_forced_agreement(model, tmodel, cfg, mesh, prompts, res.tokens)
  assert wrong["identical_up_to_ties"] is False
  assert wrong["max_abs_logit_diff"] > 10 * same["max_abs_logit_diff"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["agentic", "--nosuch"], "error: argument '--nosuch' is not of the form key=value"),
        (["step", "batch_size=abc"], "error: invalid value for 'batch_size'='abc'"),
        (["rollout", "learning_rat=1"], "error: unknown config key 'learning_rat'"),
    ],
)
def test_a_benchmarks_config_mistake_is_one_line(argv, needle, capsys):
  try:
    rc = bench_main.main(argv)
  except SystemExit as e:
    rc = e.code
  err = capsys.readouterr().err
  assert rc == 2 and err.startswith(needle) and err.count("\n") == 1, err
