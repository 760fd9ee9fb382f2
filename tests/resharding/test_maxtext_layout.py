"""resharding/maxtext_layout.py: MaxText's converter gets the trainer's layer structure (`TrainerLayers`), not the config.

`MaxTextToMaxTextConverter` reads its `config` argument through `getattr` with defaults, so a narrower object that
lacked a name it reads would silently get MaxText's default instead of the trainer's value. The reference here is the
real converter at the pinned MaxText, built from the whole config: every name it reads must be a `TrainerLayers` field,
and the converter built from `TrainerLayers` must resolve every setting as the one built from the config does.
"""

from __future__ import annotations

import pytest
from maxtext.integration.vllm import weight_converter

from maxtext_rl_plugin.config.load import load_config
from maxtext_rl_plugin.resharding import maxtext_layout

MOE = [
    "model_name=qwen3-30b-a3b",
    "base_emb_dim=64",
    "base_mlp_dim=32",
    "base_moe_mlp_dim=32",
    "num_experts=4",
    "num_experts_per_tok=2",
    "head_dim=16",
]


class _Recording:
  """The config, recording every attribute read (the `getattr` with a default included)."""

  def __init__(self, config):
    self._config, self.read = config, set()

  def __getattr__(self, name):
    self.read.add(name)
    return getattr(self._config, name)


def _settings(converter) -> dict:
  return {k: v for k, v in vars(converter).items() if k != "config"}


@pytest.mark.parametrize("argv", [[], MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tp, prefuse", [(1, False), (4, True)])
def test_the_converter_reads_only_trainer_layers_and_resolves_the_same(argv, tp, prefuse):
  config = load_config(["configs/cpu_tiny.yml", "base_num_kv_heads=4", *argv])
  kwargs = {"tp": tp, "kv_tp_size": tp, "moe_mlp_tp_size": tp, "prefuse_moe_weights": prefuse}  # as AdapterLayout
  recording = _Recording(config)
  whole = weight_converter.MaxTextToMaxTextConverter(config=recording, **kwargs)
  layers = maxtext_layout.TrainerLayers.from_config(config)
  narrow = weight_converter.MaxTextToMaxTextConverter(config=layers, **kwargs)
  fields = set(maxtext_layout.TrainerLayers.__dataclass_fields__)
  assert recording.read and recording.read <= fields, sorted(recording.read - fields)
  assert _settings(narrow) == _settings(whole)
