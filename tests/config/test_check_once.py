"""Each first-pass check runs once (issue 47): the typed pass repeats a check only where it reads another value."""

import collections

from maxtext_rl_plugin.run import identity as run_identity
from maxtext_rl_plugin.run import meta as run_meta
from maxtext_rl_plugin import train_rl
from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin.config import precheck as config_precheck
from maxtext_rl_plugin.config import validation


def test_the_typed_pass_does_not_repeat_the_first_passs_checks(tmp_path, monkeypatch):
  calls = collections.Counter()
  for module, name in ((run_identity, "check_inputs"), (run_identity, "check_outputs"), (validation, "check_run")):
    real = getattr(module, name)

    def counted(config, real=real, name=name):
      calls[name] += 1
      return real(config)

    monkeypatch.setattr(module, name, counted)
  argv = ["configs/cpu_tiny.yml", f"base_output_directory={tmp_path}", "run_name=once", "metrics_file=m.jsonl"]
  view = config_precheck.precheck(argv)
  done = train_rl._precheck(view)  # pylint: disable=protected-access
  assert calls == {"check_run": 1, "check_inputs": 1, "check_outputs": 1}
  config = config_lib.typed(view.source()).hyperparameters()
  assert done.run == (config.run_name, config.base_output_directory)
  assert done.paths == run_identity.path_values(config)  # the typed config reads every path key as the view did
  run_meta.preflight(config, done.paths)
  assert calls == {"check_run": 1, "check_inputs": 1, "check_outputs": 1}
  # A value the first pass did not check (here: another metrics_file) is checked in the typed pass.
  other = list(done.paths)
  other[run_identity.PATH_KEYS.index("metrics_file")] = "elsewhere.jsonl"
  run_meta.preflight(config, tuple(other))
  assert calls == {"check_run": 1, "check_inputs": 2, "check_outputs": 2}
