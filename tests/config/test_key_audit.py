"""Where the plugin's behaviour differs from what MaxText's RL defaults mean (issue 42's audit of the refused keys).

A refused key accepts only MaxText's RL default (`post_train/rl.yml` over `base.yml`), which reads as a promise of
MaxText's default behaviour. For each key below that promise does not hold as such; its status must say what the plugin
does instead (or the key is honoured). The MaxText defaults are read from the installed maxtext wheel, not copied, so a
MaxText upgrade that changes one fails here; docs/DEVELOPMENT.md carries the same table for readers.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin.config import key_status

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "DEVELOPMENT.md"

# key -> (MaxText RL default, words of its status that state what the plugin does)
AUDIT = {
    "checkpoint_storage_use_ocdbt": (False, "honoured (checkpointing.Storage"),
    "checkpoint_storage_use_zarr3": (False, "honoured (checkpointing.Storage"),
    "checkpoint_storage_concurrent_gb": (96, "honoured (checkpointing.Storage"),
    "checkpoint_storage_device_host_concurrent_gb": (8, "honoured (checkpointing.Storage"),
    "checkpoint_storage_target_data_file_size_bytes": (2147483648, "honoured (checkpointing.Storage"),
    "abort_on_nan_loss": (True, "logs a warning for a non-finite step metric and goes on"),
    "abort_on_inf_loss": (True, "logs a warning for a non-finite step metric and goes on"),
    "save_checkpoint_on_start": (True, "first checkpoint is at checkpoint_period"),
    "lr_schedule_type": ("cosine", "cosine decay to 0"),
    "learning_rate_final_fraction": (0.1, "cosine decay to 0"),
    "add_bos": (True, "HF tokenizer's own defaults"),
    "add_eos": (True, "no EOS is appended"),
    "decode_sampling_strategy": ("greedy", "samples with decode_sampling_temperature/top_k/nucleus_p"),
    "swap_space_vllm_gb": (2, "vLLM's own default applies"),
    "gc_collect_after_weight_sync": (True, "does not call gc.collect"),
    "use_weight_converter": (True, "always an explicit converter"),
    "rollout_backend": ("maxtext", "maps weights itself"),
    "math_verify_timeout": (120, "reward_item_timeout_seconds"),
    "enable_dropout": (True, "dropout is set by dropout_rate"),
}


@pytest.mark.parametrize("key", sorted(AUDIT))
def test_the_audited_key_has_maxtexts_rl_default_and_says_what_the_plugin_does(key):
  default, says = AUDIT[key]
  assert key_status.same_value(config_keys._rl_default(key), default)  # pylint: disable=protected-access
  assert says in key_status.status(key), key_status.status(key)


def test_the_development_doc_lists_the_audit():
  text = DOC.read_text(encoding="utf-8")
  section = text.split("## Where the plugin differs from MaxText's RL defaults", 1)[1].split("\n## ", 1)[0]
  listed = set(re.findall(r"^\| `([a-z0-9_.]+)`", section, re.M))
  assert listed == set(AUDIT)
