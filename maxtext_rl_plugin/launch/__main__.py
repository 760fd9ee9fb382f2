"""`python -m maxtext_rl_plugin.launch {xpk,xpk-delete,xpk-list,ray} [flags] -- [train_rl key=value ...]`.

  xpk         submit train_rl to Pathways on GKE (`xpk workload create-pathways`); --dry-run prints the command
  xpk-delete  delete a workload (`xpk workload delete`)
  xpk-list    list workloads (`xpk workload list`)
  ray         run train_rl on every worker of Ray Train's JaxTrainer (KubeRay TPU slices, or CPU workers)

Everything after `--` is passed to train_rl as overrides of the config (default configs/rl.yml) and validated
here first. Mistakes end with one `error: ...` line and exit 2. See docs/tutorial.md.
"""

# Ray is optional (the `ray` extra): imported only by the ray subcommand.
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from maxtext_rl_plugin import errors
from maxtext_rl_plugin.launch import xpk as xpk_lib


class _Parser(argparse.ArgumentParser):
  """argparse that raises a one-line LaunchError instead of printing usage and exiting."""

  def error(self, message: str):
    raise xpk_lib.LaunchError(f"{self.prog}: {message}")


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  argv = list(argv)
  if "--" in argv:
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]
  return argv, []


def _parser() -> argparse.ArgumentParser:
  """The launcher's command line: one subcommand per target (xpk, xpk-delete, xpk-list, ray, ...)."""
  p = _Parser(
      prog="python -m maxtext_rl_plugin.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

  x = sub.add_parser("xpk", help="xpk workload create-pathways for train_rl")
  x.add_argument("--workload", required=True, help="xpk workload name; also train_rl's run_name unless overridden")
  x.add_argument("--cluster", required=True)
  x.add_argument("--tpu-type", required=True, help="an xpk TPU type, e.g. v5p-128, v6e-16")
  x.add_argument("--project", required=True)
  x.add_argument("--docker-image", required=True, help="image with maxtext-rl-plugin[tpu] installed")
  x.add_argument("--num-slices", type=int, default=1)
  x.add_argument("--priority", default="medium", help=f"one of {', '.join(xpk_lib.PRIORITIES)}")
  x.add_argument("--zone", default=None, help="only for xpk < 0.14, which cannot discover the cluster's location")
  x.add_argument("--max-restarts", type=int, default=None)
  x.add_argument("--config", default=xpk_lib.DEFAULT_CONFIG, help="train_rl yml (a shipped name or a path in the image)")
  x.add_argument("--dry-run", action="store_true", help="print the xpk command (one line) and run nothing")
  x.add_argument(
      "--allow-local-output",
      action="store_true",
      help="accept a base_output_directory that is not gs:// (a volume every pod mounts); refused otherwise",
  )

  for name, helptext in (("xpk-delete", "xpk workload delete"), ("xpk-list", "xpk workload list")):
    d = sub.add_parser(name, help=helptext)
    d.add_argument("--workload", required=name == "xpk-delete")
    d.add_argument("--cluster", required=True)
    d.add_argument("--project", default=None)
    d.add_argument("--zone", default=None)
    d.add_argument("--dry-run", action="store_true")
    if name == "xpk-delete":
      d.add_argument("--force", action="store_true", help="delete without xpk's confirmation prompt")

  r = sub.add_parser("ray", help="Ray Train JaxTrainer running train_rl on each worker")
  r.add_argument("--num-workers", type=int, required=True, help="one per TPU VM host (or per CPU process)")
  r.add_argument("--tpu-topology", default=None, help="e.g. 4x4; with --accelerator-type selects TPU workers")
  r.add_argument("--accelerator-type", default=None, help="Ray accelerator type, e.g. TPU-V6E")
  r.add_argument("--chips-per-worker", type=int, default=4, help="TPU chips per worker (resources_per_worker TPU)")
  r.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPU workers only")
  r.add_argument("--cpu-devices-per-worker", type=int, default=1, help="JAX host devices per CPU worker")
  r.add_argument("--config", default=xpk_lib.DEFAULT_CONFIG)
  r.add_argument(
      "--entry",
      default="train_rl",
      choices=("train_rl", "smoke"),
      help="train_rl, or smoke: one tiny GRPO step to check the cluster's multi-process JAX",
  )
  r.add_argument(
      "--name", default=None, help="Ray run name; also train_rl's run_name unless overridden (the same name resumes)"
  )
  r.add_argument("--storage-path", default=None, help="Ray Train storage (shared across nodes, e.g. /data or gs://)")
  r.add_argument("--result-dir", default=None, help="smoke: write each worker's metrics to <dir>/rank<i>.json")
  r.add_argument(
      "--address",
      default=None,
      help="Ray cluster: host:port (the head's GCS), ray://host:port, auto or local (default: RAY_ADDRESS or a local "
      "cluster); a head that does not answer within seconds is one error line",
  )
  r.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray cluster started by the launcher")
  r.add_argument(
      "--max-failures",
      type=int,
      default=0,
      help="Ray FailureConfig(max_failures): restart the worker group after a failure up to N times "
      "(-1: forever); train_rl resumes from the newest checkpoint",
  )
  r.add_argument("--dry-run", action="store_true", help="print the JaxTrainer setup and run nothing")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0 if argv else 2
  flags, overrides = _split(argv)
  errors.quiet_third_party_logs()  # before validation imports transformers (MAXTEXT_RL_VERBOSE=1 keeps its lines)
  with errors.exit_on_user_error():
    args = _parser().parse_args(flags)  # -h/--help: argparse prints the subcommand's help and exits 0
    if args.cmd == "xpk":
      cmd = xpk_lib.build_create(
          workload=args.workload,
          cluster=args.cluster,
          tpu_type=args.tpu_type,
          project=args.project,
          docker_image=args.docker_image,
          overrides=overrides,
          num_slices=args.num_slices,
          priority=args.priority,
          zone=args.zone,
          max_restarts=args.max_restarts,
          config=args.config,
          allow_local_output=args.allow_local_output,
      )
      for w in xpk_lib.warnings_for(overrides, args.max_restarts, dict(os.environ)):
        print(f"warning: {w}", file=sys.stderr, flush=True)
      return xpk_lib.run(cmd, dry_run=args.dry_run)
    if overrides and args.cmd != "ray":
      raise xpk_lib.LaunchError(f"{args.cmd} takes no train_rl overrides (got '{overrides[0]}')")
    if args.cmd == "xpk-delete":
      return xpk_lib.run(
          xpk_lib.build_delete(
              workload=args.workload, cluster=args.cluster, project=args.project, zone=args.zone, force=args.force
          ),
          dry_run=args.dry_run,
      )
    if args.cmd == "xpk-list":
      return xpk_lib.run(
          xpk_lib.build_list(cluster=args.cluster, project=args.project, zone=args.zone, workload=args.workload),
          dry_run=args.dry_run,
      )
    from maxtext_rl_plugin.launch import ray as ray_lib

    return ray_lib.run(ray_lib.from_args(args, overrides), dry_run=args.dry_run)
  return 2


if __name__ == "__main__":
  sys.exit(main())
