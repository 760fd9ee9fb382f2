"""dependencies/: the TPU image recipe (Dockerfile, pins, build/upload scripts), checked without Docker or a TPU.

- The Dockerfile is parsed (BuildKit's own parser via the `dockerfile` package when installed, and a small
  parser here) and its COPY/RUN references are checked against the repository.
- The pins are checked for consistency with setup.cfg and, over the network, against the registry: every
  pinned wheel must exist for the image's platform (manylinux x86_64, CPython 3.12) and the only declared
  requirement the pins violate must be the documented qwix override.
- The scripts run against stub `docker`/`gcloud` executables that record their arguments.
"""

# Two imports stay where they are used: dockerfile (optional, the test falls back to its own parser) and
# dependencies/scripts/verify_pins.py (a script, importable only once its directory is put on sys.path).
# pylint: disable=import-outside-toplevel

from __future__ import annotations

import configparser
import importlib.metadata as md
import json
import os
import pathlib
import re
import subprocess
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DEPS = REPO / "dependencies"
SCRIPTS = DEPS / "scripts"


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
  """(INSTRUCTION, arguments) per instruction: comments dropped, `\\` continuations joined."""
  out, buf = [], ""
  for raw in text.splitlines():
    line = raw.rstrip()
    if not buf and (not line.strip() or line.lstrip().startswith("#")):
      continue
    if buf and line.lstrip().startswith("#"):
      continue
    if line.endswith("\\"):
      buf += line[:-1] + " "
      continue
    buf += line
    instr, _, args = buf.strip().partition(" ")
    out.append((instr.upper(), " ".join(args.split())))
    buf = ""
  assert not buf, "dangling line continuation at end of Dockerfile"
  return out


def read_pins(path: pathlib.Path) -> dict[str, str]:
  """`name==version` pins of a requirements file, by canonical name."""
  pins = {}
  for line in path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
      continue
    req = Requirement(line)
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{path.name}: not an exact pin: {line}"
    pins[re.sub(r"[-_.]+", "-", req.name).lower()] = specs[0].version
  return pins


def setup_cfg() -> configparser.ConfigParser:
  cp = configparser.ConfigParser()
  cp.read(REPO / "setup.cfg")
  return cp


def _reqs(block: str) -> dict[str, Requirement]:
  out = {}
  for line in block.splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
      req = Requirement(line)
      out[req.name.lower()] = req
  return out


# ------------------------------------------------------------------ Dockerfile


VALID = {
    "FROM",
    "ARG",
    "ENV",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "LABEL",
    "USER",
    "ENTRYPOINT",
    "CMD",
    "EXPOSE",
    "VOLUME",
    "SHELL",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "ONBUILD",
}


def test_dockerfile_parses_and_references_exist():
  text = (DEPS / "Dockerfile").read_text()
  instrs = parse_dockerfile(text)
  assert all(i in VALID for i, _ in instrs), [i for i, _ in instrs if i not in VALID]
  try:
    import dockerfile
  except ImportError:
    dockerfile = None
  if dockerfile is not None:  # BuildKit's parser agrees on the instruction sequence
    official = dockerfile.parse_string(text)
    assert [c.cmd.upper() for c in official] == [i for i, _ in instrs]

  # FROM is the MaxText post-training image, passed as ARG BASE_IMAGE declared before it.
  first_from = next(k for k, (i, _) in enumerate(instrs) if i == "FROM")
  assert instrs[first_from][1] == "${BASE_IMAGE}"
  assert any(i == "ARG" and a.startswith("BASE_IMAGE") for i, a in instrs[:first_from])

  copied: set[str] = set()
  for instr, args in instrs:
    if instr == "COPY":
      parts = [p for p in args.split() if not p.startswith("--")]
      srcs, dest = parts[:-1], parts[-1]
      for src in srcs:
        assert (REPO / src).exists(), f"COPY source {src} missing from the repository"
        name = pathlib.PurePosixPath(src).name
        copied.add(str(pathlib.PurePosixPath(dest) / name) if dest.endswith("/") else dest)
        copied.add(src.rstrip("/"))
    if instr == "RUN":
      for cmd in re.split(r"&&|;", args):
        if "pip install" not in cmd:
          continue
        for flag, ref in re.findall(r"(?:^|\s)(-r|-c)\s+(\S+)", cmd):
          assert ref in copied, f"pip uses {ref} ({flag}) before it is copied in"
      for script in re.findall(r"python3 (\S+\.py)", args):
        assert script in copied and (REPO / script).is_file(), script
  # Everything setup.cfg builds the wheel from is in the image: package dirs, long_description file, pyproject.
  opts = setup_cfg()["options"]
  pkg_dirs = {line.split("=", 1)[1].strip() for line in opts["package_dir"].splitlines() if "=" in line}
  readme = setup_cfg()["metadata"]["long_description"].split(":", 1)[1].strip()
  needed = pkg_dirs | {"setup.py", "setup.cfg", "pyproject.toml", readme}
  assert needed <= copied, needed - copied
  run = " ".join(a for i, a in instrs if i == "RUN")
  assert "--no-deps -r dependencies/requirements-tpu.txt" in run
  # The plugin: a non-editable --no-deps install with its tpu extra, from a copy of its sources that is then removed,
  # so no source folder is left to shadow the installed package in the jobs' working directory.
  src = next(a.split("=", 1)[1] for i, a in instrs if i == "ARG" and a.startswith("PLUGIN_SRC="))
  assert not src.startswith(next(a.split("=", 1)[1] for i, a in instrs if i == "ARG" and a.startswith("PLUGIN_DIR=")))
  assert 'pip install --no-deps "${PLUGIN_SRC}[tpu]" && rm -rf ${PLUGIN_SRC}' in run
  for instr, args in instrs:
    if instr == "COPY" and any(s.rstrip("/") in needed for s in args.split()[:-1]):
      assert args.split()[-1].startswith("${PLUGIN_SRC}/"), args
  # The build's import check names the modules a run starts with, not only the rollout stack.
  check = re.search(r'python3 -c "([^"]*)"', run).group(1)
  for module in ("maxtext_rl_plugin.train_rl", "maxtext_rl_plugin.run.loop", "maxtext_rl_plugin.rollout.vllm"):
    assert re.search(rf"\b{re.escape(module)}\b", check), module


def test_dockerignore_keeps_every_copy_source():
  keep = [l[1:].strip() for l in (DEPS / "Dockerfile.dockerignore").read_text().splitlines() if l.startswith("!")]
  rules = [l.strip() for l in (DEPS / "Dockerfile.dockerignore").read_text().splitlines() if l.strip() and l[0] != "#"]
  assert rules[0] == "**", "exclude everything first, then re-include what the Dockerfile copies"
  for instr, args in parse_dockerfile((DEPS / "Dockerfile").read_text()):
    if instr != "COPY":
      continue
    for src in [p for p in args.split() if not p.startswith("--")][:-1]:
      src = src.rstrip("/")
      assert any(k in (src, src + "/**") for k in keep), f"{src} would be excluded from the build context"


# ------------------------------------------------------------------ pins


def test_pins_are_exact_and_agree_with_setup_cfg():
  pins = read_pins(DEPS / "constraints.txt")
  names = [
      l.strip()
      for l in (DEPS / "requirements-tpu.txt").read_text().splitlines()
      if l.strip() and not l.startswith(("#", "-"))
  ]
  assert "-c constraints.txt" in (DEPS / "requirements-tpu.txt").read_text()
  assert {n.lower() for n in names} == set(pins), "every installed package has exactly one pin"
  for must in ("maxtext", "google-tunix", "vllm-tpu", "tpu-inference", "pathwaysutils", "jax", "jaxlib", "libtpu"):
    assert must in pins, must
  cfg = setup_cfg()
  base = _reqs(cfg["options"]["install_requires"])
  tpu = _reqs(cfg["options.extras_require"]["tpu"])
  for name in ("maxtext", "google-tunix", "math-verify"):
    assert pins[name] in base[name].specifier, f"{name}: image pin {pins[name]} vs setup.cfg {base[name]}"
  for name in ("vllm-tpu", "tpu-inference", "pathwaysutils"):
    assert name in tpu and pins[name] in tpu[name].specifier, f"{name}: tpu extra {tpu.get(name)} vs image {pins[name]}"


def test_verify_pins_script(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text(f"# comment\n-c other.txt\nnumpy=={md.version('numpy')}\nabsl-py=={md.version('absl-py')}\n")

  def run(p):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "verify_pins.py"), str(p)], capture_output=True, text=True, check=False
    )

  r = run(good)
  assert r.returncode == 0 and "all 2 pins hold" in r.stdout
  bad = tmp_path / "bad.txt"
  bad.write_text("numpy==0.0.1\nnot-a-real-package-xyz==1.0\n")
  r = run(bad)
  assert r.returncode == 1
  assert "numpy:" in r.stderr and "0.0.1 pinned" in r.stderr and "not-a-real-package-xyz: not installed" in r.stderr
  loose = tmp_path / "loose.txt"
  loose.write_text("numpy>=1\n")
  assert run(loose).returncode == 2


_NET_ERRORS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Max retries exceeded",
    "No route to host",
    "ConnectTimeout",
)


@pytest.mark.network
def test_pins_resolve_to_wheels_for_the_tpu_image_platform(tmp_path):
  """Every pin exists as a wheel for manylinux x86_64 / CPython 3.12 (the image), resolved by pip itself."""
  report = tmp_path / "report.json"
  platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(17, 40)]
  platforms.append("--platform=manylinux2014_x86_64")
  cmd = [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--dry-run",
      "--no-deps",
      "--ignore-installed",
      "--quiet",
      "--disable-pip-version-check",
      "--target",
      str(tmp_path / "t"),
      "--only-binary=:all:",
      *platforms,
      "--python-version=3.12",
      "--implementation=cp",
      "--report",
      str(report),
      "-r",
      str(DEPS / "requirements-tpu.txt"),
  ]
  r = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=DEPS, timeout=600)
  if r.returncode != 0 and any(e in r.stderr for e in _NET_ERRORS):
    pytest.skip("package registry unreachable from this machine; cannot resolve the TPU pins")
  assert r.returncode == 0, r.stderr[-2000:]
  installed = {i["metadata"]["name"].lower().replace("_", "-"): i for i in json.loads(report.read_text())["install"]}
  pins = read_pins(DEPS / "constraints.txt")
  assert {k: v["metadata"]["version"] for k, v in installed.items()} == pins

  # Which declared requirements of the pinned packages do the pins violate? Only the documented qwix override.
  env = dict(default_environment(), extra="", platform_machine="x86_64", sys_platform="linux", python_version="3.12")
  violated = set()
  for name, item in installed.items():
    for line in item["metadata"].get("requires_dist") or []:
      req = Requirement(line)
      if req.marker is not None and not req.marker.evaluate(env):
        continue
      dep = req.name.lower()
      if dep in pins and not req.specifier.contains(pins[dep], prereleases=True):
        violated.add((name, dep))
  assert violated == {("tpu-inference", "qwix")}, violated
  # The jax stack is exactly the one tpu-inference is built for, and vllm-tpu's tpu-inference is ours.
  ti = {Requirement(l).name.lower(): Requirement(l) for l in installed["tpu-inference"]["metadata"]["requires_dist"]}
  for dep in ("jax", "jaxlib", "libtpu", "flax", "torchvision", "torchax", "tokamax"):
    assert str(ti[dep].specifier) == f"=={pins[dep]}", dep
  vt = {Requirement(l).name.lower(): Requirement(l) for l in installed["vllm-tpu"]["metadata"]["requires_dist"]}
  assert pins["transformers"] in vt["transformers"].specifier  # vllm-tpu's range (>=5.16.1,<5.20.0)
  tunix_qwix = next(
      Requirement(l) for l in installed["google-tunix"]["metadata"]["requires_dist"] if Requirement(l).name == "qwix"
  )
  assert pins["qwix"] in tunix_qwix.specifier  # why the override exists


# ------------------------------------------------------------------ scripts


def test_scripts_pass_bash_syntax_check():
  for script in ("build_image.sh", "upload_image.sh"):
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def _stub_bin(tmp_path: pathlib.Path, log: pathlib.Path, inspect_rc: int = 0) -> dict:
  """A PATH with a `docker` stub that logs its arguments (and fails `image inspect` with `inspect_rc`)."""
  bindir = tmp_path / "bin"
  bindir.mkdir()
  (bindir / "docker").write_text(
      f'#!/bin/bash\necho "docker $*" >> {log}\n'
      f'if [ "$1 $2" = "image inspect" ]; then exit {inspect_rc}; fi\nexit 0\n'
  )
  (bindir / "gcloud").write_text('#!/bin/bash\nif [ "$*" = "config get-value project" ]; then echo my-proj; fi\n')
  for f in bindir.iterdir():
    f.chmod(0o755)
  return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


def test_build_image_runs_maxtext_post_training_then_the_plugin_layer(tmp_path):
  log = tmp_path / "log"
  env = _stub_bin(tmp_path, log)
  mt = tmp_path / "maxtext"
  # MaxText v0.2.3/v0.2.4/v0.2.5 layout: the build scripts live under src/dependencies/scripts/.
  (mt / "src" / "dependencies" / "scripts").mkdir(parents=True)
  (mt / "src" / "dependencies" / "scripts" / "docker_build_dependency_image.sh").write_text(
      f'#!/bin/bash\necho "maxtext $PWD $*" >> {log}\n'
  )
  script = str(SCRIPTS / "build_image.sh")
  r = subprocess.run(["bash", script, f"MAXTEXT_REPO={mt}"], env=env, capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr
  lines = log.read_text().splitlines()
  assert lines[0] == f"maxtext {mt} WORKFLOW=post-training"
  assert lines[1] == (
      f"docker build --network host --build-arg BASE_IMAGE=maxtext_base_image "
      f"-f {REPO}/dependencies/Dockerfile -t maxtext_rl_plugin_image {REPO}"
  )

  log.write_text("")
  r = subprocess.run(
      ["bash", script, "BASE_IMAGE=gcr.io/p/base:1", "LOCAL_IMAGE_NAME=mine", "WORKFLOW=post-training"],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  assert r.returncode == 0, r.stderr
  assert log.read_text().splitlines() == [
      f"docker build --network host --build-arg BASE_IMAGE=gcr.io/p/base:1 -f {REPO}/dependencies/Dockerfile "
      f"-t mine {REPO}"
  ]

  for bad in (
      ["WORKFLOW=pre-training", "BASE_IMAGE=x"],
      ["WORKFLOW=post-training-experimental", "BASE_IMAGE=x"],
      [],
      ["BOGUS=1"],
      ["MAXTEXT_REPO=/nonexistent"],
      ["noequals"],
  ):
    r = subprocess.run(["bash", script, *bad], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1, (bad, r.stderr)


def test_upload_image_tags_and_pushes_to_the_registry(tmp_path):
  log = tmp_path / "log"
  env = _stub_bin(tmp_path, log)
  script = str(SCRIPTS / "upload_image.sh")
  r = subprocess.run(["bash", script, "CLOUD_IMAGE_NAME=rl-img"], env=env, capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr
  assert log.read_text().splitlines() == [
      "docker image inspect maxtext_rl_plugin_image",
      "docker tag maxtext_rl_plugin_image gcr.io/my-proj/rl-img:latest",
      "docker push gcr.io/my-proj/rl-img:latest",
  ]
  assert "--docker-image gcr.io/my-proj/rl-img" in r.stdout

  log.write_text("")
  r = subprocess.run(
      ["bash", script, "cloud_image_name=x", "PROJECT=other", "TAG=v1", "LOCAL_IMAGE_NAME=mine"],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  assert r.returncode == 0 and "docker push gcr.io/other/x:v1" in log.read_text()

  r = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=False)
  assert r.returncode == 2 and "CLOUD_IMAGE_NAME" in r.stderr
  (tmp_path / "m").mkdir()
  env_missing = _stub_bin(tmp_path / "m", tmp_path / "log2", inspect_rc=1)  # `docker image inspect` fails
  r = subprocess.run(["bash", script, "CLOUD_IMAGE_NAME=x"], env=env_missing, capture_output=True, text=True, check=False)
  assert r.returncode == 1 and "not found" in r.stderr


def _fake_dist(site: pathlib.Path, name: str, version: str, files: list[str]) -> None:
  info = site / f"{name.replace('-', '_')}-{version}.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
  (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
  for f in files:  # importlib.metadata lists only RECORD entries that exist on disk
    (site / f).parent.mkdir(parents=True, exist_ok=True)
    (site / f).write_text("")


def test_verify_pins_catches_a_second_vllm_sharing_the_vllm_directory(tmp_path):
  """Upstream vllm and vllm-tpu both ship vllm/: the one installed last overwrote the other's files."""
  sys.path.insert(0, str(SCRIPTS))
  import verify_pins

  site = tmp_path / "site"
  _fake_dist(site, "vllm-tpu", "0.32.0", ["vllm/__init__.py", "vllm/config/__init__.py"])
  _fake_dist(site, "tpu-inference", "0.32.0", ["tpu_inference/__init__.py"])
  assert verify_pins.package_owners("vllm", [str(site)]) == ["vllm-tpu"]
  assert not verify_pins.shared_package_dirs([str(site)])
  _fake_dist(site, "vllm", "0.11.0", ["vllm/__init__.py", "vllm/_C.abi3.so"])
  problems = verify_pins.shared_package_dirs([str(site)])
  assert len(problems) == 1 and "vllm, vllm-tpu" in problems[0] and "\n" not in problems[0]
  # The script itself fails on it (exit 1) even when every version pin holds.
  pins = tmp_path / "pins.txt"
  pins.write_text("vllm-tpu==0.32.0\n")
  code = (
      f"import sys; sys.path[:0] = [{str(SCRIPTS)!r}, {str(site)!r}]; import verify_pins; "
      f"sys.exit(verify_pins.main([{str(pins)!r}]))"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
  assert r.returncode == 1 and "conflict: vllm/: installed by 2 distributions" in r.stderr


def test_contract_environment_runs_the_image_pins():
  """tests/tpu_contract's environment pins the same versions as the image wherever both name a package."""
  image = read_pins(DEPS / "constraints.txt")
  contract = read_pins(DEPS / "tpu-contract-requirements.txt")
  shared = set(image) & set(contract)
  assert {
      "vllm-tpu",
      "tpu-inference",
      "jax",
      "jaxlib",
      "flax",
      "qwix",
      "maxtext",
      "torchax",
      "tokamax",
      "transformers",
      "pathwaysutils",
  } <= shared
  assert {n: contract[n] for n in shared} == {n: image[n] for n in shared}
  assert "vllm" not in contract  # upstream vllm would overwrite vllm-tpu's vllm/


MAXTEXT_LAYOUT = json.loads((REPO / "tests" / "data" / "maxtext_repo_layout.json").read_text())


@pytest.mark.parametrize("ref", sorted(MAXTEXT_LAYOUT["refs"]))
def test_build_image_against_the_real_maxtext_layout(ref, tmp_path):
  """The MaxText checkout rebuilt from the recorded layout at a real tag (tests/data/maxtext_repo_layout.json):
  build_image.sh finds MaxText's dependency-image script there and passes a WORKFLOW its setup.sh knows."""
  layout = MAXTEXT_LAYOUT["refs"][ref]
  log = tmp_path / "log"
  env = _stub_bin(tmp_path, log)
  mt = tmp_path / "maxtext"
  for path in layout["scripts"]:
    (mt / path).parent.mkdir(parents=True, exist_ok=True)
    body = f'echo "maxtext $PWD $*" >> {log}\n' if path.endswith("/docker_build_dependency_image.sh") else "exit 1\n"
    (mt / path).write_text("#!/bin/bash\n" + body)
  r = subprocess.run(
      ["bash", str(SCRIPTS / "build_image.sh"), f"MAXTEXT_REPO={mt}"],
      env=env,
      capture_output=True,
      text=True,
      check=False,
  )
  assert r.returncode == 0, r.stderr
  first = log.read_text().splitlines()[0]
  workflow = re.search(r"WORKFLOW=(\S+)", first).group(1)
  assert workflow in layout["setup_sh_workflows"], (workflow, layout["setup_sh_workflows"])


def test_the_longest_first_test_order_names_existing_modules():
  """tests/conftest.py orders modules for pytest-xdist; a renamed module would silently drop back to the end."""
  import conftest  # pylint: disable=import-outside-toplevel  # the tests directory's own conftest

  present = {p.stem for p in (REPO / "tests").rglob("test_*.py")}  # tests mirror the source tree: any folder
  missing = [m for m in conftest._LONGEST_FIRST if m not in present]  # pylint: disable=protected-access
  assert not missing, missing
