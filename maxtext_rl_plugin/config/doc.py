"""`python -m maxtext_rl_plugin.config.doc > docs/config_reference.md`: the configuration reference, generated.

Every key of the resolved `configs/rl.yml` -- the plugin's own keys and those it inherits from MaxText's
`post_train/rl.yml` through `base_config` -- with its default (the value the yml chain gives it) and its meaning
(the pydantic `Field` description from `config_types.PluginRLConfig`, i.e. the plugin's descriptions and MaxText's
own `types.py` ones) and its status (`config/key_status.py`: honoured where, or refused why); then every other key of the
schema with its status. Generated rather than written so the reference cannot drift from the schema and the yml;
tests/config/test_docs.py regenerates it and fails when the committed file differs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence

import omegaconf

from maxtext_rl_plugin.config import files as config_files
from maxtext_rl_plugin.config import keys as config_keys
from maxtext_rl_plugin import errors
from maxtext_rl_plugin.config import key_status

REGENERATE = "python -m maxtext_rl_plugin.config.doc > docs/config_reference.md"
DEFAULT_YML = "configs/rl.yml"


def _raw_chain(yml: str) -> tuple[dict[str, Any], dict[str, Any], str]:
  """(merged yml chain, the plugin file's own keys, the MaxText base file's name) without pydantic post-processing.

  Raw yml values, not `load_pydantic` output: MaxText's post-processing fills machine-dependent values (absolute
  asset paths, timestamped run names) that would make the generated file differ between machines.
  """
  path = config_files.resolve_yml(yml)
  merged = config_files.merged_chain(path)
  own = omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.load(path), resolve=False)
  return merged, own, str(own.get("base_config", ""))


def _fmt_value(value: Any) -> str:
  """A default as one short inline-code cell (JSON, cut at 80 characters)."""
  if value is None:
    text = "null"
  elif isinstance(value, str):
    text = json.dumps(value)
  else:
    text = json.dumps(value, separators=(", ", ": "))
  if len(text) > 80:
    text = text[:77] + "..."
  return "`" + text.replace("`", "'") + "`"


def _fmt_desc(text: str | None) -> str:
  """A description on one line, safe inside a Markdown table cell."""
  return " ".join((text or "").split()).replace("|", "\\|")


def _fmt_status(key: str) -> str:
  """The key's status (`config/key_status.py`) as a table cell."""
  return _fmt_desc(key_status.status(key) or "(no status)")


def rows(yml: str = DEFAULT_YML) -> list[tuple[str, str, str, str]]:
  """(key, default, meaning, source) for every key of the resolved yml, nested blocks flattened as `rl.key`."""
  schema = config_keys.config_class()
  merged, own, base = _raw_chain(yml)
  nested = config_keys.nested_models(schema)
  plugin_src = os.path.basename(config_files.resolve_yml(yml))
  out = []
  for key, value in merged.items():
    if key == "base_config":
      continue
    if key in nested and isinstance(value, dict):
      own_block = own.get(key) if isinstance(own.get(key), dict) else {}
      for inner, inner_value in value.items():
        field = nested[key].model_fields.get(inner)
        src = plugin_src if inner in own_block else base
        out.append((f"{key}.{inner}", _fmt_value(inner_value), _fmt_desc(field.description if field else ""), src))
      continue
    field = schema.model_fields.get(key)
    src = plugin_src if key in own else base
    out.append((key, _fmt_value(value), _fmt_desc(field.description if field else ""), src))
  return out


def render(yml: str = DEFAULT_YML) -> str:
  """The whole reference page (Markdown) for `yml`."""
  all_rows = rows(yml)
  _, _, base = _raw_chain(yml)
  name = os.path.basename(yml)
  plugin = [r for r in all_rows if r[3] != base]
  inherited = [r for r in all_rows if r[3] == base]
  lines = [
      "# Configuration reference",
      "",
      f"<!-- Generated from {yml} and maxtext_rl_plugin/config/schema.py; do not edit. Regenerate with: {REGENERATE} -->",
      "",
      f"Every key of the resolved `{yml}`: {len(plugin)} set by the plugin's `{name}` and {len(inherited)} inherited",
      f"from MaxText 0.2.5's `{base}` through `base_config`. *Default* is the value the yml chain gives the key;",
      "*meaning* is the key's schema description (`maxtext_rl_plugin.config.schema.PluginRLConfig`, which extends",
      "MaxText's `types.RLConfig`). Override any key on the command line as `key=value`; keys of nested blocks as",
      "`rl.kl_estimator=k1` (keys MaxText also keeps flat, such as `loss_algo`, work either way). Unknown keys and",
      "invalid values are rejected with one line naming the key, on your machine by the launchers before a job is",
      "submitted.",
      "",
      "*Status* says whether the plugin honours a key (and where) or refuses it (and why): setting a refused key to",
      "anything but MaxText's own RL default (`post_train/rl.yml` over `base.yml`) is an error, so no key is ever",
      "accepted and then ignored (`maxtext_rl_plugin/config/key_status.py`).",
      "",
      f"The schema accepts {len(config_keys.config_class().model_fields)} top-level keys in all; those not "
      "listed here keep",
      "MaxText's defaults (`configs/base.yml`, model files under `configs/models/`). `print_config=true` prints every",
      "resolved value of a run and exits.",
      "",
      f"This file is generated: `{REGENERATE}`.",
      "",
  ]
  for title, group in ((f"Plugin keys (`{name}`)", plugin), (f"Inherited from MaxText `{base}`", inherited)):
    lines += [f"## {title}", "", "| key | default | meaning | status |", "| --- | --- | --- | --- |"]
    lines += [f"| `{k}` | {v} | {d} | {_fmt_status(k)} |" for k, v, d, _ in group]
    lines.append("")
  listed = {r[0] for r in all_rows}
  rest = [k for k in key_status.all_keys() if k not in listed and key_status.canonical(k) not in listed]
  lines += [
      "## Every other key of the schema",
      "",
      f"The {len(rest)} keys neither yml sets (MaxText's `base.yml` and model files give their defaults).",
      "",
      "| key | status |",
      "| --- | --- |",
  ]
  lines += [f"| `{k}` | {_fmt_status(k)} |" for k in rest]
  lines.append("")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Print the reference for argv[0] (default configs/rl.yml) to stdout."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0

  with errors.exit_on_user_error():
    sys.stdout.write(render(argv[0] if argv else DEFAULT_YML))
  return 0


if __name__ == "__main__":
  sys.exit(main())
