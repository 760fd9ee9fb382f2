"""The benchmark entry points run at tiny sizes and end with the JSON keys the docs quote."""

import argparse
import ast
import importlib
import json
import pathlib
import re

import numpy as np
import pytest

from maxtext_rl_plugin.bench import __main__ as bench_main
from maxtext_rl_plugin.bench import common as bench_common
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


# ----------------------------------------------------------------------------------------------------------------------
# Every benchmark's flags have a bound; every result line is finite JSON (issue 61)
# ----------------------------------------------------------------------------------------------------------------------

_NUMERIC_TEXT = re.compile(r"^[\d.,\s-]+$")  # a default such as "1,8,32": a list of numbers given as text


class _Parsed(Exception):
  """Raised instead of parsing: the benchmark's parser is captured before anything runs."""


def _parser_of(name, monkeypatch):
  """Benchmark `name`'s argparse parser, as its main() builds it (nothing after the parse runs)."""
  captured = []

  def capture(self, *_args, **_kwargs):
    captured.append(self)
    raise _Parsed

  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)  # parse_args calls it too
  module = importlib.import_module(bench_main.BENCHMARKS[name])
  with pytest.raises(_Parsed):
    module.main([])
  return captured[0]


@pytest.mark.parametrize("name", sorted(bench_main.BENCHMARKS))
def test_every_numeric_flag_of_every_benchmark_has_a_bound(name, monkeypatch):
  """`bench peak --n -5`, `bench rewards --repeat 0` ... were tracebacks (or `Infinity` in the JSON): each flag that
  takes a number (or a list of numbers) is parsed by one of bench/common.py's bounded types, and a mistake is one
  line (common.ArgumentParser). A new numeric flag with `type=int` fails here."""
  parser = _parser_of(name, monkeypatch)
  assert isinstance(parser, bench_common.ArgumentParser), type(parser)
  unbounded = []
  for action in parser._actions:  # pylint: disable=protected-access  # argparse has no public list of its actions
    numeric = action.type in (int, float) or (
        action.type is None
        and (
            (isinstance(action.default, (int, float)) and not isinstance(action.default, bool))
            or (isinstance(action.default, str) and _NUMERIC_TEXT.match(action.default))
        )
    )
    if numeric or (action.type is not None and not hasattr(action.type, "bound") and action.type is not str):
      unbounded.append("/".join(action.option_strings) or action.dest)
  assert not unbounded, f"bench {name}: numeric flags without a bound: {unbounded}"


@pytest.mark.parametrize(
    "argv, heavy, needle",
    [
        (["peak", "--repeats", "0"], "peak.measure_peak_flops", "'--repeats'=0: must be >= 1"),  # wrote Infinity
        (["peak", "--n", "-5"], "peak.measure_peak_flops", "'--n'=-5: must be >= 1"),
        (["peak", "--n", "1e3"], "peak.measure_peak_flops", "'--n'='1e3': expected an integer"),
        (["rewards", "--repeat", "0"], "rewards.build_rows", "'--repeat'=0: must be >= 1"),
        (["rewards", "--limit", "-1"], "rewards.build_rows", "'--limit'=-1: must be >= 0"),
        (["rewards", "--batch-size", "0"], "rewards.build_rows", "'--batch-size'=0: must be >= 1"),
        (["rollout", "--repeats", "0"], "rollout._build", "'--repeats'=0: must be >= 1"),
        (["rollout", "--batch-sizes", "8,0"], "rollout._build", "'--batch-sizes'='8,0': expected comma-separated"),
        (["lora", "--alpha", "inf"], "common.start_split_bench", "'--alpha'=inf: must be > 0"),
        (["step", "--warmup", "-1"], "common.force_host_devices", "'--warmup'=-1: must be >= 0"),
        (["moe", "--router-scales", "1,-0.1"], "moe.models.setup_devices", "'--router-scales'='1,-0.1'"),
    ],
)
def test_an_out_of_bound_flag_is_one_line_before_any_work(argv, heavy, needle, monkeypatch, capsys):
  """The issue's cases and one per kind of bound: one `error:` line naming the flag and its value, exit 2, and the
  benchmark's first piece of work (`heavy`) never reached."""
  module_name, attr = heavy.rsplit(".", 1)
  target = importlib.import_module(f"maxtext_rl_plugin.bench.{module_name.split('.')[0]}")
  for part in module_name.split(".")[1:]:
    target = getattr(target, part)
  monkeypatch.setattr(target, attr, lambda *a, **k: pytest.fail(f"reached {heavy}"))
  try:
    rc = bench_main.main(argv)
  except SystemExit as e:
    rc = e.code
  err = capsys.readouterr().err
  assert rc == 2 and err.startswith(f"error: invalid value for {needle}") and err.count("\n") == 1, err


def test_a_result_line_never_holds_nan_or_infinity(capsys):
  """Python's json writes NaN/Infinity, which JSON does not have (strict parsers refuse the line): non-finite
  numbers are written as null and named in one warning line."""
  text = bench_common.finite_json({"a": 1.5, "b": {"c": float("inf")}, "d": [float("nan"), 2], "e": np.float64("-inf")})

  def refuse(constant):
    raise AssertionError(f"{constant} in the JSON")

  assert json.loads(text, parse_constant=refuse) == {"a": 1.5, "b": {"c": None}, "d": [None, 2], "e": None}
  assert capsys.readouterr().err == "warning: not a finite number, written as null: b.c, d[0], e\n"


def test_every_result_line_and_record_goes_through_finite_json():
  """No benchmark writes its results with json.dump / print(json.dumps(...)) directly (a NaN would pass)."""
  direct = []
  for path in sorted(pathlib.Path(bench_common.__file__).parent.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if not isinstance(node, ast.Call):
        continue
      func = node.func
      if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "json":
        if func.attr == "dump":
          direct.append(f"{path.name}:{node.lineno}")
      is_output = (isinstance(func, ast.Name) and func.id == "print") or (
          isinstance(func, ast.Attribute) and func.attr == "write"
      )
      if is_output and any(
          isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "dumps" for a in node.args
      ):
        direct.append(f"{path.name}:{node.lineno}")
  assert not direct, direct
