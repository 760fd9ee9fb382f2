"""`launch ray`: run `train_rl` on every worker of Ray Train's `JaxTrainer` (KubeRay on GKE, or any Ray cluster).

This is the pattern of the "JAX, Ray Train and TPU Trillium on GKE" tutorial, with MaxText's `train.main`
replaced by the plugin's `train_rl.main`: one Ray worker per TPU VM host, `ScalingConfig(use_tpu=True,
topology=..., accelerator_type=..., resources_per_worker={"TPU": chips})`, and `JaxTrainer` runs the same SPMD
program on each host (Ray's JAX backend calls `jax.distributed.initialize` on TPU).

On CPU workers Ray's JAX backend does no distributed setup at all (ray 2.60 `_JaxBackend.on_start` returns early
unless use_tpu/use_gpu), so the worker function does it: rank 0 picks a coordinator address, Ray broadcasts it,
and every worker calls `jax.distributed.initialize(address, world_size, rank)` with gloo CPU collectives. Workers
never inherit the submitting shell's `XLA_FLAGS` (a test shell forcing 8 host devices would otherwise give every
worker 8 devices); `--cpu-devices-per-worker` sets the count explicitly.

`--entry smoke` runs `maxtext_rl_plugin.launch.smoke.grpo_step` instead of train_rl: a seconds-long check that the
cluster's multi-process JAX (coordinator, collectives) and the plugin's GRPO loss work before a real run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
import sys
import uuid
from typing import Any, Sequence

from absl import logging

# Function-local imports: `ray` is an optional extra (`[launch]`), and a worker imports jax, the smoke step and
# train_rl only after it has set JAX_PLATFORMS / XLA_FLAGS for its own devices (the driver never initialises jax).
# pylint: disable=import-outside-toplevel

from maxtext_rl_plugin import errors
from maxtext_rl_plugin import run_dir
from maxtext_rl_plugin import storage
from maxtext_rl_plugin.config import validation
from maxtext_rl_plugin.launch import xpk as xpk_lib

ENTRIES = ("train_rl", "smoke")
DEFAULT_CONFIG = xpk_lib.DEFAULT_CONFIG
# Environment of TPU workers, as in the Ray Train tutorial.
TPU_WORKER_ENV = {"JAX_PLATFORMS": "tpu", "ENABLE_PJRT_COMPATIBILITY": "true"}
_FORCE_DEVICES_RE = re.compile(r"--xla_force_host_platform_device_count=\S+")

# A Ray address as `ray.init` takes it: `auto` / `local` (Ray resolves them), `host:port` (the head's GCS port) or
# `ray://host:port` (Ray Client). Ray's own parser takes `not-an-address:xx` apart and raises a ValueError traceback
# deep in ray.init; an address that nothing answers on (a closed port, a firewalled head) makes ray.init retry for
# minutes. Both are checked here first: the form before --dry-run returns, the head by a short probe before ray.init.
ADDRESS_KEYWORDS = ("auto", "local")
_ADDRESS_RE = re.compile(r"^(?:ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]@?#]+):(?P<port>[0-9]{1,5})$")
ADDRESS_FORMS = "host:port (the head's GCS port, e.g. 10.0.0.2:6379), ray://host:port (Ray Client), auto or local"
# Seconds the probe waits for the head to accept a TCP connection and then to answer the HTTP/2 preface (GCS and the
# Ray Client server are gRPC servers: HTTP/2, which answers a client preface with its SETTINGS frame at once).
PROBE_TIMEOUT_S = 5.0
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS


# Every numeric flag of `launch ray` (a field of RayLaunch) -> (accepts the value, what is expected); None (unset) is
# not checked. tests/launch/test_launch_ray.py fails when a numeric field is missing here.
NUMERIC_FLAGS: dict[str, tuple[float, bool, str]] = {  # field -> (bound, strictly above it, what is expected)
    "num_workers": (1, False, ">= 1"),
    "chips_per_worker": (1, False, ">= 1"),
    "cpus_per_worker": (0, True, "> 0 (Ray's CPU resources per worker)"),
    "cpu_devices_per_worker": (1, False, ">= 1"),
    "num_cpus": (1, False, ">= 1 (CPUs of the local Ray cluster)"),
    "max_failures": (-1, False, ">= -1 (-1: retry forever)"),
}


@dataclasses.dataclass
class RayLaunch:
  """Everything `JaxTrainer` needs, built and validated on the driver before any worker starts."""

  num_workers: int
  overrides: list[str]
  config: str = DEFAULT_CONFIG
  entry: str = "train_rl"
  tpu_topology: str | None = None
  accelerator_type: str | None = None
  chips_per_worker: int = 4
  cpus_per_worker: float = 1.0
  cpu_devices_per_worker: int = 1
  name: str | None = None
  storage_path: str | None = None
  result_dir: str | None = None
  address: str | None = None
  num_cpus: int | None = None
  max_failures: int = 0
  # One id per `launch ray` invocation; every restart of its worker group (FailureConfig) keeps it, so the restarted
  # process 0 takes over the run lock of its dead predecessor at once, wherever Ray placed either (run_dir.RunLock).
  launch_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])

  @property
  def use_tpu(self) -> bool:
    return bool(self.tpu_topology or self.accelerator_type)

  def validate(self, *, check_overrides: bool = True) -> None:
    """Reject bad flags (one `LaunchError` line) and, for train_rl, bad overrides, before Ray starts anything."""
    for field, (bound, strict, expected) in NUMERIC_FLAGS.items():
      value = getattr(self, field)
      if value is not None and not (math.isfinite(value) and (value > bound if strict else value >= bound)):
        raise xpk_lib.LaunchError(f"--{field.replace('_', '-')} must be {expected}, got {value}")
    if self.entry not in ENTRIES:
      raise xpk_lib.LaunchError(f"invalid --entry '{self.entry}': expected one of {', '.join(ENTRIES)}")
    if self.use_tpu and not (self.tpu_topology and self.accelerator_type):
      raise xpk_lib.LaunchError("TPU workers need both --tpu-topology (e.g. 4x4) and --accelerator-type (e.g. TPU-V6E)")
    self.head()  # the address's form, also for --dry-run (ray.init would raise a ValueError traceback)
    if self.entry == "train_rl" and check_overrides:
      pc = xpk_lib.validate_overrides(self.config, self.train_argv()[1:])
      validation.check_processes(pc, self.num_workers)  # what the trainer refuses across processes, before Ray starts

  def head(self, environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """(host, port) of the head node ray.init connects to: --address, or RAY_ADDRESS where ray.init reads it (no
    --address, or `auto`); None where Ray starts or finds a local cluster itself."""
    environ = os.environ if environ is None else environ
    env = environ.get("RAY_ADDRESS", "").strip()
    if env and (self.address is None or self.address.strip() == "auto"):
      return head_address(env, "RAY_ADDRESS")
    return head_address(self.address)

  def run_name(self) -> str:
    return self.name or xpk_lib.override_value(self.overrides, "run_name") or "maxtext-rl"

  def scaling_config_kwargs(self) -> dict[str, Any]:
    """`ScalingConfig` kwargs: the Ray tutorial's TPU settings (one worker per host), or CPU workers."""
    if self.use_tpu:
      return {
          "num_workers": self.num_workers,
          "use_tpu": True,
          "topology": self.tpu_topology,
          "accelerator_type": self.accelerator_type,
          "resources_per_worker": {"TPU": self.chips_per_worker},
          "placement_strategy": "SPREAD",
      }
    return {"num_workers": self.num_workers, "use_tpu": False, "resources_per_worker": {"CPU": self.cpus_per_worker}}

  def worker_env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
    """env_vars of the workers' runtime_env: platform, XLA flags, the launch id (run lock) and the HF token passed
    through."""
    environ = os.environ if environ is None else environ
    if self.use_tpu:
      env = dict(TPU_WORKER_ENV)
    else:
      env = {
          "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": _cpu_xla_flags(environ.get("XLA_FLAGS", ""), self.cpu_devices_per_worker),
      }
    env["RAY_TRAIN_V2_ENABLED"] = "1"
    env[run_dir.LAUNCH_ID_ENV] = f"ray:{self.run_name()}:{self.launch_id}"
    token = self.hf_token() or environ.get(xpk_lib.SECRET_ENV)
    if token:
      env[xpk_lib.SECRET_ENV] = token
    return env

  def hf_token(self) -> str | None:
    """An `hf_access_token=` override: it travels to the workers in their environment (HF_TOKEN), never in argv."""
    return xpk_lib.override_value(self.overrides, "hf_access_token") or None

  def warnings(self) -> list[str]:
    """Legal but probably unintended for a multi-host run (printed, not fatal)."""
    if self.entry != "train_rl":
      return []
    out = []
    if xpk_lib.override_value(self.overrides, "run_name") is None:
      out.append("no run_name (or --name): the yml's run_name is used, so different runs share checkpoints")
    base = xpk_lib.override_value(self.overrides, "base_output_directory") or ""
    if self.num_workers > 1 and not base.startswith(("gs://", "/data")):
      out.append(
          f"base_output_directory '{base}' should be gs:// or a shared mount: every worker writes its shards of the "
          "checkpoint there, and a restarted job must find them to resume"
      )
    return out

  def train_argv(self) -> list[str]:
    """train_rl's argv on every worker. Ray workers are a multi-controller JAX program (one process per host), not
    a Pathways client, so `use_pathways=false` is added unless set (MaxText's post_train/rl.yml defaults to true)."""
    overrides = [o for o in self.overrides if o.partition("=")[0].strip().lstrip("-") not in xpk_lib.SECRET_KEYS]
    if xpk_lib.override_value(overrides, "use_pathways") is None:
      overrides.append("use_pathways=false")
    return [self.config, *overrides]

  def loop_config(self) -> dict[str, Any]:
    return {
        "entry": self.entry,
        "argv": self.train_argv(),
        "use_tpu": self.use_tpu,
        "cpu_devices_per_worker": self.cpu_devices_per_worker,
        "result_dir": self.result_dir,
    }

  def failure_config_kwargs(self) -> dict[str, Any]:
    """Ray's FailureConfig: after a worker fails, the whole group restarts up to max_failures times; each restart
    runs train_rl again with the same run_name, which resumes from the newest complete checkpoint (batch k is a pure
    function of the step, so no batch is repeated or skipped)."""
    return {"max_failures": self.max_failures}

  def describe(self) -> str:
    """One line that says what would run (secrets redacted), for --dry-run and logs."""
    env = {k: ("***" if k == xpk_lib.SECRET_ENV else v) for k, v in self.worker_env().items()}
    return (
        f"ray JaxTrainer name={self.run_name()} entry={self.entry} "
        f"scaling={json.dumps(self.scaling_config_kwargs(), sort_keys=True)} "
        f"worker_env={json.dumps(env, sort_keys=True)} failure={json.dumps(self.failure_config_kwargs())} "
        f"argv={json.dumps(self.loop_config()['argv'])}"
    )


def head_address(address: str | None, source: str = "--address") -> tuple[str, int] | None:
  """(host, port) of the head node `address` names; None for auto, local or no address (Ray resolves those itself).
  Anything else is one `LaunchError` line naming `source` (the flag, or RAY_ADDRESS)."""
  if address is None or address.strip() in ADDRESS_KEYWORDS:
    return None
  m = _ADDRESS_RE.match(address.strip())
  port = int(m["port"]) if m else 0
  if not 1 <= port <= 65535:
    raise xpk_lib.LaunchError(f"{source} '{address}' is not a Ray address: expected {ADDRESS_FORMS}")
  return m["host"].strip("[]"), port


def probe_head(host: str, port: int, timeout_s: float | None = None) -> None:
  """Fail in seconds, in one line, where ray.init would retry for minutes: nothing listens at host:port (a closed
  port, a host that drops the connection attempt), or something accepts and never answers a gRPC client's first
  bytes (not a Ray head, or a hung one). Sends HTTP/2's client preface and waits for any answer: a GCS or Ray Client
  server replies with its SETTINGS frame at once. With TLS (RAY_USE_TLS) the server expects a TLS handshake, so only
  the connection is checked."""
  timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
  where = f"the Ray head at {host}:{port}"
  try:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
      if os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true"):
        return
      s.sendall(_HTTP2_PREFACE)
      s.recv(1)  # any byte, or the peer closing, is an answer
  except socket.timeout:
    raise xpk_lib.LaunchError(
        f"{where} did not answer within {timeout_s:g} s (a firewall dropping the connection, or a port that is not "
        "a Ray head's GCS / Ray Client port); check --address (or RAY_ADDRESS) and that `ray start --head` runs there"
    ) from None
  except OSError as e:
    why = e.strerror or str(e) or type(e).__name__
    raise xpk_lib.LaunchError(
        f"cannot reach {where}: {why}; check --address (or RAY_ADDRESS) and that `ray start --head` runs there"
    ) from None


def _cpu_xla_flags(inherited: str, devices: int) -> str:
  flags = _FORCE_DEVICES_RE.sub("", inherited).split()
  if devices > 1:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  return " ".join(flags)


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def _init_cpu_distributed(cpu_devices: int) -> bool:
  """jax.distributed on CPU workers (Ray does not); returns True when this call initialised it."""
  import ray.train
  from ray.train import collective

  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = _cpu_xla_flags(os.environ.get("XLA_FLAGS", ""), cpu_devices)
  import jax

  ctx = ray.train.get_context()
  rank, world = ctx.get_world_rank(), ctx.get_world_size()
  if world <= 1 or jax.distributed.is_initialized():
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  address = None
  if rank == 0:
    import ray.util

    address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
  address = collective.broadcast_from_rank_zero(address)
  logging.info("worker %d/%d: jax.distributed.initialize(%s) on CPU (gloo)", rank, world, address)
  jax.distributed.initialize(coordinator_address=address, num_processes=world, process_id=rank)
  return True


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
  """Runs on every Ray worker: distributed JAX setup on CPU, then train_rl (or the smoke GRPO step)."""
  import ray.train

  initialised = False if loop_config["use_tpu"] else _init_cpu_distributed(loop_config["cpu_devices_per_worker"])
  try:
    if loop_config["entry"] == "smoke":
      from maxtext_rl_plugin.launch import smoke

      metrics = smoke.grpo_step()
      rank = ray.train.get_context().get_world_rank()
      if loop_config.get("result_dir"):  # a bucket too (storage), as every output a user names
        storage.makedirs(loop_config["result_dir"])
        storage.write_atomic(os.path.join(loop_config["result_dir"], f"rank{rank}.json"), json.dumps(metrics))
      print(f"[smoke] rank {rank}: {json.dumps(metrics, sort_keys=True)}", flush=True)
      ray.train.report(metrics)
      return
    from maxtext_rl_plugin import train_rl

    argv = list(loop_config["argv"])
    if os.environ.get(xpk_lib.SECRET_ENV):  # the token came through the runtime env, not argv (never printed)
      argv.append(f"hf_access_token={os.environ[xpk_lib.SECRET_ENV]}")
    try:
      rc = train_rl.main(argv)
    except SystemExit as e:  # train_rl turns user errors into exit 2; a worker must raise, not exit
      rc = e.code
    if rc:
      raise RuntimeError(f"train_rl exited with status {rc} on worker {ray.train.get_context().get_world_rank()}")
  finally:
    if initialised:
      import jax

      jax.distributed.shutdown()


def build_trainer(launch: RayLaunch):
  """The `JaxTrainer` for `launch` (constructing it needs no cluster; `fit()` does)."""
  os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # JaxTrainer and ray.train.collective are Train V2 APIs
  try:
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer
  except ImportError:
    raise errors.MissingExtraError("the Ray launcher", "ray[train]", "launch") from None
  try:
    scaling = ScalingConfig(**launch.scaling_config_kwargs())
  except ValueError as e:
    raise xpk_lib.LaunchError(f"Ray rejected the scaling config: {' '.join(str(e).split())}") from None
  run_kwargs: dict[str, Any] = {
      "name": launch.run_name(),
      "worker_runtime_env": {"env_vars": launch.worker_env()},
      "failure_config": FailureConfig(**launch.failure_config_kwargs()),
  }
  if launch.storage_path:
    run_kwargs["storage_path"] = launch.storage_path
  return JaxTrainer(
      train_loop_per_worker=train_loop_per_worker,
      train_loop_config=launch.loop_config(),
      scaling_config=scaling,
      run_config=RunConfig(**run_kwargs),
  )


def run(launch: RayLaunch, *, dry_run: bool = False) -> int:
  """Validate, print what runs, and (unless dry_run) connect to Ray and fit. Returns an exit code."""
  launch.validate()
  trainer = build_trainer(launch)
  head = None if dry_run else launch.head()
  if head is not None:
    probe_head(*head)  # seconds, one line: ray.init retries an unreachable head for minutes
  for w in launch.warnings():
    print(f"warning: {w}", file=sys.stderr, flush=True)
  print(launch.describe(), file=sys.stdout if dry_run else sys.stderr, flush=True)
  if dry_run:
    return 0
  import ray

  init_kwargs: dict[str, Any] = {"address": launch.address, "ignore_reinit_error": True}
  if launch.num_cpus and not launch.address and not os.environ.get("RAY_ADDRESS"):
    init_kwargs["num_cpus"] = launch.num_cpus  # only meaningful for a local cluster started here
  try:
    ray.init(**init_kwargs)
  except ConnectionError as e:  # `auto` with no cluster running, a head that went away after the probe
    raise xpk_lib.LaunchError(f"Ray could not connect: {' '.join(str(e).split())[:300]}") from None
  try:
    result = trainer.fit()
  finally:
    ray.shutdown()
  if getattr(result, "error", None):
    print(f"error: Ray training failed: {result.error}", file=sys.stderr, flush=True)
    return 1
  return 0


def from_args(args: Any, overrides: Sequence[str]) -> RayLaunch:
  overrides = list(overrides)
  if args.name and xpk_lib.override_value(overrides, "run_name") is None:
    overrides.append(f"run_name={args.name}")  # a stable run_name is what lets a rerun resume
  return RayLaunch(
      num_workers=args.num_workers,
      overrides=overrides,
      config=args.config,
      entry=args.entry,
      tpu_topology=args.tpu_topology,
      accelerator_type=args.accelerator_type,
      chips_per_worker=args.chips_per_worker,
      cpus_per_worker=args.cpus_per_worker,
      cpu_devices_per_worker=args.cpu_devices_per_worker,
      name=args.name,
      storage_path=args.storage_path,
      result_dir=args.result_dir,
      address=args.address,
      num_cpus=args.num_cpus,
      max_failures=args.max_failures,
  )
