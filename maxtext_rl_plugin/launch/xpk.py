"""`launch xpk`: submit `train_rl` to Pathways on GKE with `xpk workload create-pathways`.

The plugin does not orchestrate anything itself: it builds the same `xpk workload create-pathways` command the
MaxText multi-host RL tutorial types by hand, after checking everything xpk or `train_rl` would reject later (on
the cluster, minutes after the pods are scheduled):

* workload/cluster names with xpk's own validator (`[a-z]([-a-z0-9]*[a-z0-9])?`, <= 40 characters);
* the TPU type against xpk's table of system characteristics (`xpk.core.system_characteristics`), so the set of
  accepted types is exactly the installed xpk's;
* the `key=value` overrides with the plugin's config loader (unknown keys, bad values), exactly as `train_rl`
  will load them inside the container.

Secrets: `HF_TOKEN` is passed to the container with `--env HF_TOKEN=<value>` in the real xpk invocation only;
every printed line shows the shell reference `HF_TOKEN="$HF_TOKEN"` instead (so a printed command is still
copy-pastable), and an `hf_access_token=` override is shown as `***`.

Resume: the container runs `train_rl ... run_name=<workload>` (unless the overrides set `run_name`); the trainer
restores the latest checkpoint under `<base_output_directory>/<run_name>/checkpoints/`, so resubmitting the same
command after a preemption or failure continues the run. That only survives a pod if base_output_directory is a
`gs://` bucket, which is why a local path is warned about.
"""

# xpk is optional and kept out of the training environment (its pins clash with training's; setup.cfg's `xpk`
# extra): it is imported only where a command needs its validators or TPU catalogue.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Sequence
import uuid

from absl import logging

from maxtext_rl_plugin.config import load as config_lib
from maxtext_rl_plugin import errors
from maxtext_rl_plugin import run_dir

# The Pathways client environment of the MaxText RL tutorial: JAX talks to the Pathways proxy sidecar that xpk
# runs in the same pod (hostNetwork), and Pathways keeps compiled executables across the run.
PATHWAYS_ENV = (
    ("TF_CPP_MIN_LOG_LEVEL", "0"),
    ("JAX_PLATFORMS", "proxy"),
    ("JAX_BACKEND_TARGET", "grpc://127.0.0.1:29000"),
    ("ENABLE_PATHWAYS_PERSISTENCE", "1"),
)
SECRET_ENV = "HF_TOKEN"
SECRET_KEYS = ("hf_access_token",)
REDACTED = "***"
DEFAULT_CONFIG = "configs/rl.yml"
PRIORITIES = ("very-low", "low", "medium", "high", "very-high")
# xpk's own pattern (xpk.parser.validators.name_type); used only if that function moves.
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_NAME_MAX = 40
# Lets tests (and users whose xpk lives in a separate pipx/venv) point at a specific xpk executable.
XPK_BIN_ENV = "MAXTEXT_RL_XPK"
TESTED_XPK = "1.16.0"


class LaunchError(errors.UserError):
  """A launcher argument that xpk, Ray or train_rl would reject."""


@dataclasses.dataclass(frozen=True)
class Command:
  """An external command with two renderings: `argv` to execute (may hold secrets), `shown` to print."""

  argv: tuple[str, ...]
  shown: str


def check_name(flag: str, value: str) -> str:
  """Workload/cluster names exactly as xpk validates them (its `name_type`, else the same pattern), one line."""
  try:
    from xpk.parser.validators import name_type
  except ImportError:

    def name_type(v: str) -> str:
      if not _NAME_RE.fullmatch(v) or len(v) > _NAME_MAX:
        raise argparse.ArgumentTypeError(v)
      return v

  try:
    name_type(value)
  except argparse.ArgumentTypeError:
    raise LaunchError(
        f"invalid {flag} '{value}': xpk needs lowercase letters, digits and '-', starting with a letter, not ending "
        f"with '-', at most {_NAME_MAX} characters (pattern {_NAME_RE.pattern})"
    ) from None
  return value


def tpu_types() -> list[str] | None:
  """TPU types the installed xpk knows (its system-characteristics table), e.g. v5p-128, v6e-16; None when xpk
  is not importable here (installed with pipx / in another venv), in which case xpk itself rejects bad types."""
  try:
    from xpk.core import system_characteristics as sc
  except ImportError:
    return None
  return sc.get_system_characteristics_keys_by_accelerator_type([sc.AcceleratorType.TPU])


def check_tpu_type(value: str) -> str:
  known = tpu_types()
  if known is None:
    logging.warning("xpk is not importable here; --tpu-type '%s' will be validated by xpk itself", value)
    return value
  if value not in known:
    close = difflib.get_close_matches(value, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; xpk knows {len(known)} types such as v5p-128, v6e-16"
    raise LaunchError(f"unknown --tpu-type '{value}' for xpk{hint}")
  return value


def override_value(overrides: Sequence[str], key: str) -> str | None:
  """The value the last `key=value` override gives `key` (as pyconfig applies them), or None."""
  value = None
  for o in overrides:
    k, _, v = o.partition("=")
    if k.strip().lstrip("-") == key:
      value = v
  return value


def validate_overrides(config: str, overrides: Sequence[str]):
  """Load `<config> <overrides>` as train_rl will inside the container (returned); raises ConfigError (one line)."""
  # MaxText logs notes about cluster-side defaults (e.g. a local base_output_directory) while loading: noise here.
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    return config_lib.load_pydantic([config, *overrides])
  finally:
    logging.set_verbosity(verbosity)


def train_overrides(workload: str, overrides: Sequence[str]) -> list[str]:
  """The user's overrides, plus `run_name=<workload>` unless given: the run name is what makes resume work."""
  out = list(overrides)
  if override_value(out, "run_name") is None:
    out.append(f"run_name={workload}")
  return out


def _shown_override(o: str) -> str:
  key, sep, value = o.partition("=")
  if sep and key.strip().lstrip("-") in SECRET_KEYS and not value.startswith("$"):
    return f"{key}={REDACTED}"
  return o


def container_command(
    config: str, overrides: Sequence[str], *, pass_hf_token: bool, redact: bool = False, launch_id: str = ""
) -> str:
  """The shell command xpk runs in the main container (env prefix + train_rl), as in the tutorial.

  `redact=True` renders secret-valued overrides (`hf_access_token=...`) as `***` for printing. `launch_id` becomes
  `MAXTEXT_RL_LAUNCH_ID`: it is part of the JobSet's pod template, so every restart of the JobSet runs with the same
  id and takes over its previous attempt's run lock at once (run_dir.RunLock) instead of after the lock's 60 s.
  """
  parts = [f"{k}={v}" for k, v in PATHWAYS_ENV]
  if launch_id:
    parts.append(f"{run_dir.LAUNCH_ID_ENV}={shlex.quote(launch_id)}")
  parts += ["python3", "-m", "maxtext_rl_plugin.train_rl", shlex.quote(config)]
  parts += [shlex.quote(_shown_override(o) if redact else o) for o in overrides]
  if pass_hf_token and override_value(overrides, "hf_access_token") is None:
    # Expanded by the container's shell from the env var set with --env, never by the submitting shell.
    parts.append(f'hf_access_token="${SECRET_ENV}"')
  return " ".join(parts)


def render(argv: Sequence[str], secret_env_value: str | None = None) -> str:
  """One shell line for `argv`: `--env HF_TOKEN=...` becomes the reference `HF_TOKEN="$HF_TOKEN"`, and any
  remaining occurrence of the secret value is masked, so the line never contains it."""
  out = []
  for i, a in enumerate(argv):
    if i > 0 and argv[i - 1] == "--env" and a.startswith(f"{SECRET_ENV}="):
      out.append(f'{SECRET_ENV}="${SECRET_ENV}"')
    else:
      out.append(shlex.quote(a))
  line = " ".join(out)
  if secret_env_value and len(secret_env_value) >= 8:  # a real token; masking a 1-char "token" would mangle the line
    line = line.replace(secret_env_value, REDACTED)
  return line


def xpk_executable() -> list[str]:
  exe = os.environ.get(XPK_BIN_ENV) or shutil.which("xpk")
  if exe:
    return shlex.split(exe)
  try:
    importlib.import_module("xpk")
    return [sys.executable, "-m", "xpk.main"]
  except ImportError:
    raise errors.MissingExtraError("the XPK launcher", "xpk", "xpk") from None


def build_create(
    *,
    workload: str,
    cluster: str,
    tpu_type: str,
    project: str,
    docker_image: str,
    overrides: Sequence[str] = (),
    num_slices: int = 1,
    priority: str = "medium",
    zone: str | None = None,
    max_restarts: int | None = None,
    config: str = DEFAULT_CONFIG,
    environ: dict[str, str] | None = None,
    validate: bool = True,
    allow_local_output: bool = False,
) -> Command:
  """Validated `xpk workload create-pathways ...` for train_rl; raises a one-line UserError on bad input."""
  environ = os.environ if environ is None else environ
  check_name("--workload", workload)
  check_name("--cluster", cluster)
  check_tpu_type(tpu_type)
  if num_slices < 1:
    raise LaunchError(f"--num-slices must be >= 1, got {num_slices}")
  if priority not in PRIORITIES:
    raise LaunchError(f"invalid --priority '{priority}': expected one of {', '.join(PRIORITIES)}")
  if max_restarts is not None and max_restarts < 0:
    raise LaunchError(f"--max-restarts must be >= 0, got {max_restarts}")
  if not docker_image or any(c.isspace() for c in docker_image):
    raise LaunchError(f"invalid --docker-image '{docker_image}'")
  if not project:
    raise LaunchError("--project is required")
  train_args = train_overrides(workload, overrides)
  if validate:
    base = str(validate_overrides(config, train_args).base_output_directory or "")
    check_output_directory(base, allow_local_output)
  token = environ.get(SECRET_ENV) or None
  argv = [
      "workload",
      "create-pathways",
      "--workload",
      workload,
      "--cluster",
      cluster,
      "--tpu-type",
      tpu_type,
      "--num-slices",
      str(num_slices),
      "--project",
      project,
  ]
  if zone:
    argv += ["--zone", zone]
  argv += ["--priority", priority]
  if max_restarts is not None:
    argv += ["--max-restarts", str(max_restarts)]
  argv += ["--docker-image", docker_image]
  if token:
    argv += ["--env", f"{SECRET_ENV}={token}"]
  # One id per submission, fixed in the pod template: a JobSet restart keeps it, a resubmission gets a new one.
  launch_id = f"xpk:{workload}:{uuid.uuid4().hex[:16]}"
  command = functools.partial(container_command, config, train_args, pass_hf_token=bool(token), launch_id=launch_id)
  shown = [*argv, "--command", command(redact=True)]
  argv += ["--command", command()]
  return Command(argv=tuple(argv), shown="xpk " + render(shown, token))


def build_delete(
    *, workload: str, cluster: str, project: str | None = None, zone: str | None = None, force: bool = False
) -> Command:
  check_name("--workload", workload)
  check_name("--cluster", cluster)
  argv = ["workload", "delete", "--workload", workload, "--cluster", cluster]
  argv += _project_zone(project, zone)
  if force:
    argv.append("--force")
  return Command(argv=tuple(argv), shown="xpk " + render(argv))


def build_list(
    *, cluster: str, project: str | None = None, zone: str | None = None, workload: str | None = None
) -> Command:
  check_name("--cluster", cluster)
  argv = ["workload", "list", "--cluster", cluster]
  argv += _project_zone(project, zone)
  if workload:
    argv += ["--filter-by-job", workload]
  return Command(argv=tuple(argv), shown="xpk " + render(argv))


def _project_zone(project: str | None, zone: str | None) -> list[str]:
  out = []
  if project:
    out += ["--project", project]
  if zone:
    out += ["--zone", zone]
  return out


def check_output_directory(base: str, allow_local_output: bool) -> None:
  """A Pathways workload's outputs must outlive its pods: base_output_directory (from the yml or an override) is a
  bucket, or the user says with --allow-local-output that the path is a volume every pod mounts. One line otherwise."""
  if base.startswith("gs://") or allow_local_output:
    return
  shown = f"'{base}'" if base else "not set"
  raise LaunchError(
      f"base_output_directory is {shown}: outputs written inside the pod (checkpoints, metrics, the run lock) are lost "
      "with it and a resubmitted workload cannot resume; give base_output_directory=gs://BUCKET/PATH, or "
      "--allow-local-output when that path is a volume every pod mounts"
  )


def warnings_for(overrides: Sequence[str], max_restarts: int | None, environ: dict[str, str]) -> list[str]:
  """Things that are legal but probably not what a cluster run wants (printed to stderr, not fatal)."""
  del overrides  # base_output_directory is checked (check_output_directory), not warned about
  out = []
  if not environ.get(SECRET_ENV):
    out.append(f"{SECRET_ENV} is not set: gated Hugging Face models/tokenizers/datasets will fail to download")
  try:
    version = importlib.metadata.version("xpk")
  except importlib.metadata.PackageNotFoundError:
    version = None
  if version and version != TESTED_XPK:
    out.append(f"xpk {version} is installed; this launcher was tested with xpk {TESTED_XPK}")
  if max_restarts:
    out.append(
        "xpk 1.16.0 accepts --max-restarts but does not write it into the Pathways JobSet; to resume after a "
        "failure, resubmit the same command (same workload/run_name)"
    )
  return out


def run(cmd: Command, *, dry_run: bool) -> int:
  """Print the command (one line, secrets redacted); execute it unless dry_run. Returns the exit code."""
  if dry_run:
    print(cmd.shown, flush=True)
    return 0
  print(f"+ {cmd.shown}", file=sys.stderr, flush=True)
  logging.info("running xpk: %s", cmd.shown)
  try:
    return subprocess.run([*xpk_executable(), *cmd.argv], check=False).returncode
  except FileNotFoundError as e:
    raise LaunchError(
        f"could not run xpk ({e.filename}); install it with: pipx install xpk==1.16.0 (or set MAXTEXT_RL_XPK)"
    ) from None
