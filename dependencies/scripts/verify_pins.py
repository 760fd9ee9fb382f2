"""Check that the installed distributions match a constraints file's `name==version` pins.

Run in the image build (dependencies/Dockerfile) so a base image or a later layer that moved the stack
fails the build instead of a TPU job hours later. Also fails when more than one distribution installs the
`vllm/` package directory: upstream `vllm` and `vllm-tpu` both ship it, and whichever was installed last
silently replaced the other's files while both keep their metadata (so the version pins alone still "hold").
Usage: python3 verify_pins.py constraints.txt
Exit status: 0 all pins hold, 1 some differ or are missing, 2 bad usage/file.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def read_pins(path: str) -> dict[str, str]:
  """`name==version` pins of a requirements file (comments and pip options skipped)."""
  pins = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if not line or line.startswith("-"):
        continue
      m = _PIN.match(line)
      if not m:
        raise ValueError(f"{path}: not an exact pin: {line!r}")
      pins[m.group(1)] = m.group(2)
  return pins


def mismatches(pins: dict[str, str]) -> list[str]:
  """One line per pinned package whose installed version differs from its pin (or that is missing)."""
  bad = []
  for name, want in sorted(pins.items()):
    try:
      have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      bad.append(f"{name}: not installed (want {want})")
      continue
    if have != want:
      bad.append(f"{name}: {have} installed, {want} pinned")
  return bad


def package_owners(package: str, path: list[str] | None = None) -> list[str]:
  """Names of the installed distributions whose RECORD lists files under `package/` (sorted)."""
  owners = set()
  for dist in importlib.metadata.distributions(**({"path": path} if path is not None else {})):
    files = dist.files or []
    if any(f.parts and f.parts[0] == package for f in files):
      owners.add(dist.metadata["Name"])
  return sorted(owners)


def shared_package_dirs(path: list[str] | None = None) -> list[str]:
  """Problems: a package directory (vllm/) written by more than one distribution."""
  owners = package_owners("vllm", path)
  if len(owners) > 1:
    return [
        f"vllm/: installed by {len(owners)} distributions ({', '.join(owners)}); the last one overwrote the "
        "other's files. Keep only vllm-tpu: pip uninstall -y vllm, then reinstall vllm-tpu --no-deps"
    ]
  return []


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print("usage: verify_pins.py CONSTRAINTS_FILE", file=sys.stderr)
    return 2
  try:
    pins = read_pins(argv[0])
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  bad = mismatches(pins)
  for line in bad:
    print(f"pin mismatch: {line}", file=sys.stderr)
  shared = shared_package_dirs()
  for line in shared:
    print(f"conflict: {line}", file=sys.stderr)
  bad += shared
  if not bad:
    print(f"all {len(pins)} pins hold")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
