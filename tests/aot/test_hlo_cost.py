"""aot/hlo_cost.py counts every loop iteration (reading the module through aot/hlo_text.py), against references
independent of it.

* XLA's analysis through the private binding equals `compiled.cost_analysis()` on loop-free programs (CPU; v5p).
* A nested `jax.lax.scan`'s gradient: the counted FLOPs are within 5% of a hand count of its matmuls (CPU; v5p),
  where XLA as reported gives a fraction of it.
* Slice-aware bytes: a hand-written layer body that reads its slice of a stacked weight through a bitcast in its
  fusion (the TPU pattern) counts the slice by hand, where XLA's analysis counts the whole stack; on v5p a scan over
  16 stacked weights counts within 10% of XLA's own figure for the same layers unrolled.
* A tiny MaxText model's update for v5p-8 with `scan_layers=true` counts what the same with `scan_layers=false`
  (no loops) reports: FLOPs to 1%, bytes to 10% (the scanned program moves its stacked weights and residuals
  around the loop: more real copies, measured +6%).
* Parse regressions on hand-written HLO: a computation ends only at a lone `}`; the counter is read through copies
  and CPU's wrapped add/compare fusions; a loop stepping by 2; the decode's `counter < T and ...` is a bound.

The v5p checks run in one subprocess (this file as a script, libtpu on its path as tests/aot/test_aot.py does).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from maxtext_rl_plugin.aot import hlo_cost, hlo_text

REPO = pathlib.Path(__file__).resolve().parents[2]
LIBTPU = REPO / ".venv-aot-libtpu"
L1, L2, B, D = 3, 4, 32, 128  # nested scan: 3 x 4 layers of [D, D] on a [B, D] carry
STACK = 16  # layers of the slice-aware check


def _nested(w, x):
  def outer(c, wo):
    def inner(c2, wi):
      return jnp.tanh(c2 @ wi), None

    return jax.lax.scan(inner, c, wo)[0], None

  return jax.lax.scan(outer, x, w)[0].sum()


def _nested_hand(b: int, d: int) -> float:
  """Forward and backward matmuls of `_nested`'s gradient: 3 per layer (x @ w; dx, dw), 2 B D^2 each."""
  return 3 * L1 * L2 * 2 * b * d * d


def _loop_free(w, x):
  return jnp.tanh(jnp.tanh(x @ w) @ w.T).sum()


def _stacked(w, x):
  return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]


def _unrolled(w, x):
  for i in range(STACK):
    x = jnp.tanh(x @ w[i])
  return x


def _cost(compiled) -> hlo_cost.LoopCost:
  return hlo_cost.module_cost(compiled.as_text(), compiled.cost_analysis())


def test_private_binding_is_xlas_cost_analysis_on_a_loop_free_program():
  c = jax.jit(_loop_free).lower(jnp.ones((D, D)), jnp.ones((B, D))).compile()
  want = c.cost_analysis()
  got = hlo_cost._xla_cost(c.as_text())  # pylint: disable=protected-access  # the private binding's contract
  assert got["flops"] == want["flops"] > 2 * 2 * B * D * D
  assert got["bytes accessed"] == pytest.approx(want["bytes accessed"], rel=0.01)
  lc = _cost(c)
  assert not lc.loops and (lc.flops, lc.bytes_accessed) == (want["flops"], want["bytes accessed"])


def test_nested_scan_gradient_counts_every_iteration_on_cpu():
  c = jax.jit(jax.grad(_nested)).lower(jnp.ones((L1, L2, D, D)), jnp.ones((B, D))).compile()
  lc = _cost(c)
  hand = _nested_hand(B, D)
  assert lc.flops == pytest.approx(hand, rel=0.05)
  assert lc.xla_flops < hand / 10  # XLA as reported: one outer and one inner iteration, forward and backward
  inner = sorted(lp.runs for lp in lc.loops)
  assert inner == [L1, L1, L1 * L2, L1 * L2] and not lc.bounded and lc.uncounted == 0


# -- hand-written modules: the loop-counter analysis --------------------------------------------------------------

_SYNTH = """HloModule synth

%wrapped_add (a: s32[], b: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %s = s32[] add(%a, %b)
}

%wrapped_compare (a.1: s32[], b.1: s32[]) -> pred[] {
  %a.1 = s32[] parameter(0)
  %b.1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%a.1, %b.1), direction=LT
}

%body (t: (s32[], f32[8,16], f32[16,16])) -> (s32[], f32[8,16], f32[16,16]) {
  %t = (s32[], f32[8,16], f32[16,16]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %i.c = s32[] copy(%i)
  %step = s32[] constant(STEP)
  %next = s32[] fusion(%i.c, %step), kind=kLoop, calls=%wrapped_add
  %x = f32[8,16] get-tuple-element(%t), index=1
  %w = f32[16,16] get-tuple-element(%t), index=2
  %y = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %o = (s32[], f32[8,16], f32[16,16]) tuple(%next, %y, %w)
}

%cond (t.1: (s32[], f32[8,16], f32[16,16])) -> pred[] {
  %t.1 = (s32[], f32[8,16], f32[16,16]) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  %n = s32[] constant(BOUND)
  COND
}

ENTRY %main (x.0: f32[8,16], w.0: f32[16,16]) -> f32[8,16] {
  %x.0 = f32[8,16] parameter(0)
  %w.0 = f32[16,16] parameter(1)
  %start = s32[] constant(START)
  %start.c = s32[] copy(%start)
  %init = (s32[], f32[8,16], f32[16,16]) tuple(%start.c, %x.0, %w.0)
  %loop = (s32[], f32[8,16], f32[16,16]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8,16] get-tuple-element(%loop), index=1
}
"""
_LT = "ROOT %c = pred[] fusion(%i.1, %n), kind=kLoop, calls=%wrapped_compare"
_DECODE = """%c = pred[] fusion(%i.1, %n), kind=kLoop, calls=%wrapped_compare
  %done = pred[] constant(false)
  %more = pred[] not(%done)
  ROOT %both = pred[] and(%c, %more)"""
_DOT = 2 * 8 * 16 * 16


def _synth(start=0, bound=12, step=1, cond=_LT) -> str:
  return _SYNTH.replace("START", str(start)).replace("BOUND", str(bound)).replace("STEP", str(step)).replace("COND", cond)


def test_counter_is_read_through_copies_and_wrapped_fusions():
  lc = hlo_cost.module_cost(_synth(start=2, bound=12))
  (loop,) = lc.loops
  assert (loop.trips, loop.runs, loop.bounded) == (10, 10, False)
  assert lc.xla_flops < 2 * _DOT and lc.flops == pytest.approx(10 * _DOT, rel=0.01)


def test_a_loop_that_steps_by_2_runs_half_as_often():
  (loop,) = hlo_cost.module_cost(_synth(bound=12, step=2)).loops
  assert loop.trips == 6


def test_the_decode_condition_is_a_bound():
  lc = hlo_cost.module_cost(_synth(bound=7, cond=_DECODE))
  assert lc.loops[0].trips == 7 and lc.bounded


_SLICE_FUSION = """%sliced (a: f32[4,16,16], b: s32[], x: f32[8,16]) -> f32[8,16] {
  %a = f32[4,16,16] parameter(0)
  %b = s32[] parameter(1)
  %x = f32[8,16] parameter(2)
  %z = s32[] constant(0)
  %ab = f32[4,16,16] bitcast(%a)
  %ds = f32[1,16,16] dynamic-slice(%ab, %b, %z, %z), dynamic_slice_sizes={1,16,16}
  %bc = f32[16,16] bitcast(%ds)
  ROOT %d = f32[8,16] dot(%x, %bc), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

"""


def test_a_layer_reads_its_slice_of_the_stacked_weight():
  # The body reads layer i of a [4, 16, 16] stack through a bitcast inside its fusion (as TPU fusions are built):
  # XLA's analysis of the body counts the whole stack; the slice is 16 x 16 floats.
  text = _synth(bound=4).replace("f32[16,16]", "f32[4,16,16]").replace("%wrapped_add (", _SLICE_FUSION + "%wrapped_add (")
  text = text.replace(
      "%y = f32[8,16] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
      "%y = f32[8,16] fusion(%w, %i.c, %x), kind=kOutput, calls=%sliced",
  )
  lc = hlo_cost.module_cost(text)
  (loop,) = lc.loops
  fusion = 16 * 16 * 4 + 4 + 2 * 8 * 16 * 4  # the slice, the index, x, the result
  counter = 4 + 4 + 3 * 4  # the copy and the add of the counter
  assert loop.bytes_accessed == fusion + counter
  assert loop.xla_bytes_accessed >= 4 * 16 * 16 * 4  # the whole stack
  assert lc.bytes_accessed == pytest.approx(lc.xla_bytes_accessed + 4 * loop.bytes_accessed - loop.xla_bytes_accessed)
  assert lc.flops == pytest.approx(4 * _DOT, rel=0.02)


def test_a_computation_ends_only_at_a_lone_brace():
  # An attribute continued on a line that starts with '}' (as MaxText's Qwen3-MoE module has) is not the end of the
  # entry computation: its while loop after it is still found and counted.
  multi = '  %note = f32[8,16] copy(%x.0), backend_config={"a":\n{"b": 1}\n}, frontend_attributes={k="v"}\n'
  text = _synth(bound=5).replace("  %start = s32[]", multi + "  %start = s32[]")
  hlo = hlo_text.HloText(text)
  assert "note" in hlo.instrs(hlo.entry)
  (loop,) = hlo.whiles(hlo.entry)
  assert hlo.trip_count(hlo.entry, loop) == (5, False)


def test_a_computation_on_another_thread_ends_at_its_closing_line():
  # TPU modules print SparseCore computations (MaxText's sparse MoE scatter on v5p, layer bodies on tpu7x) closed by
  # `}, execution_thread="sparsecore"`: missing that end swallowed the next computations, so a loop body re-entered
  # as a module lacked its callees (XLA: "computation does not exist"; on v5p a segfault in its parser).
  sc = '%sc (p: s32[]) -> s32[] {\n  ROOT %p = s32[] parameter(0)\n}, execution_thread="sparsecore"\n\n'
  text = _synth(bound=7).replace("%wrapped_compare (", sc + "%wrapped_compare (")
  hlo = hlo_text.HloText(text)
  assert {"sc", "wrapped_compare", "body", "cond", "main"} <= set(hlo.spans)
  (loop,) = hlo.whiles(hlo.entry)
  assert hlo.trip_count(hlo.entry, loop) == (7, False)
  assert hlo_cost.module_cost(text).flops == pytest.approx(7 * _DOT, rel=0.01)


def test_tile_padding_is_counted_as_xla_counts_it():
  assert hlo_text.array_bytes("bf16[4,64]{1,0:T(8,128)(2,1)}") == 8 * 128 * 2
  assert hlo_text.array_bytes("(f32[2,3]{1,0}, s8[5])") == 2 * 3 * 4 + 5


# -- v5p (libtpu) -------------------------------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(
    not (LIBTPU / "libtpu").is_dir(), reason="libtpu not installed in .venv-aot-libtpu (scripts/venv.sh installs it)"
)


@pytest.fixture(name="v5p", scope="module")
def v5p_fixture():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{LIBTPU}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  env.pop("XLA_FLAGS", None)
  res = subprocess.run(
      [sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
  )
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.strip().splitlines()[-1])


@needs_libtpu
def test_v5p_private_binding_is_xlas_cost_analysis(v5p):
  got, want = v5p["binding"]
  assert got["flops"] == want["flops"] > 0
  assert got["bytes accessed"] == pytest.approx(want["bytes accessed"], rel=0.01)


@needs_libtpu
def test_v5p_nested_scan_gradient_counts_every_iteration(v5p):
  r = v5p["nested"]
  assert r["flops"] == pytest.approx(r["hand"], rel=0.05) and r["xla_flops"] < r["hand"] / 10
  assert r["uncounted"] == 0  # every trip count read from the loop (TPU records none)


@needs_libtpu
def test_v5p_a_scan_over_stacked_weights_counts_what_the_unrolled_layers_report(v5p):
  r = v5p["stack"]
  assert r["flops"] == pytest.approx(r["unrolled_flops"], rel=0.02)
  assert r["bytes"] == pytest.approx(r["unrolled_bytes"], rel=0.1)
  assert r["xla_bytes"] < r["unrolled_bytes"] / 4  # as reported: one layer's bytes


@needs_libtpu
def test_v5p_tiny_maxtext_update_scanned_counts_what_unscanned_reports(v5p):
  scanned, unrolled = v5p["maxtext"]["true"], v5p["maxtext"]["false"]
  assert not unrolled["loops"] and scanned["loops"]
  assert scanned["flops"] == pytest.approx(unrolled["flops"], rel=0.01)
  assert scanned["bytes"] == pytest.approx(unrolled["bytes"], rel=0.1)
  assert scanned["xla_flops"] < 0.99 * unrolled["flops"]


def _v5p_probe() -> dict:
  """The v5p figures the tests above check (run as a script, with libtpu importable)."""
  # pylint: disable=import-outside-toplevel  # the TPU topology and MaxText: only in this subprocess
  import numpy as np
  from maxtext_rl_plugin.config import load as config_lib
  from maxtext_rl_plugin.run import models
  from maxtext_rl_plugin.aot import compile as compile_lib
  from maxtext_rl_plugin.aot import programs
  from maxtext_rl_plugin.aot import topology

  topology.quiet_libtpu_env()
  devices = topology.topology_devices("v5p-8", 1)
  one = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), jax.sharding.PartitionSpec())

  def compile_(f, *shapes, dtype=jnp.float32):
    return jax.jit(f).lower(*(jax.ShapeDtypeStruct(s, dtype, sharding=one) for s in shapes)).compile()

  out = {}
  c = compile_(_loop_free, (4 * D, 4 * D), (4 * B, 4 * D))
  out["binding"] = [hlo_cost._xla_cost(c.as_text()), c.cost_analysis()]  # pylint: disable=protected-access
  lc = _cost(compile_(jax.grad(_nested), (L1, L2, 4 * D, 4 * D), (8 * B, 4 * D)))
  out["nested"] = {"flops": lc.flops, "xla_flops": lc.xla_flops, "hand": _nested_hand(8 * B, 4 * D), "uncounted": 0}
  out["nested"]["uncounted"] = lc.uncounted
  shapes = ((STACK, 4 * D, 4 * D), (8, 4 * D))
  lc = _cost(compile_(_stacked, *shapes, dtype=jnp.bfloat16))
  ref = compile_(_unrolled, *shapes, dtype=jnp.bfloat16).cost_analysis()
  out["stack"] = {
      "flops": lc.flops,
      "bytes": lc.bytes_accessed,
      "xla_bytes": lc.xla_bytes_accessed,
      "unrolled_flops": ref["flops"],
      "unrolled_bytes": ref["bytes accessed"],
  }
  out["maxtext"] = {}
  for scan in ("true", "false"):
    argv = [
        "configs/cpu_tiny.yml",
        "run_name=hlo_cost",
        "base_num_decoder_layers=4",
        "max_prefill_predict_length=32",
        "max_target_length=64",
        f"scan_layers={scan}",
    ]
    rs = models.setup_devices(config_lib.parse(argv), devices=devices)
    update, _ = programs.actor_update(
        rs.trainer_config, programs.trainer_mesh(rs.trainer_config, rs.trainer_devices), False
    )
    r = compile_lib.compile_program(update)
    out["maxtext"][scan] = {
        "flops": r.flops,
        "bytes": r.bytes_accessed,
        "xla_flops": r.xla_flops,
        "loops": len(r.loops["loops"]),
    }
  return out


if __name__ == "__main__":
  print(json.dumps(_v5p_probe()))
