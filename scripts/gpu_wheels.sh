#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the GPU image lacks into .whl/ (gitignored), for
# scripts/gpu_bench.sh to install there with --no-index. The GPU image already holds JAX 0.11.2 + CUDA 13, flax,
# optax, orbax, PyTorch and transformers (the device tool's KINDS.md); MaxText 0.2.5 asks jax>=0.11.1, so the image's
# JAX serves and is not carried. flax/optax/orbax are carried at the versions the TPU contract tests run on jax
# 0.11.2 (dependencies/tpu-contract-requirements.txt): the image's versions are not recorded, and these three move
# in step with MaxText. Every wheel is x86-64 / CPython 3.12.
#
#   bash scripts/gpu_wheels.sh            # download, strip MaxText's unused tokenizer assets, print sizes
#   LIMIT_MIB=60 bash scripts/gpu_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
LIMIT_MIB="${LIMIT_MIB:-60}"
PY="${PYTHON:-python3}"

# What MaxText 0.2.5 + Tunix 0.1.7 + the plugin import at run time and the image lacks (or holds at an unknown
# version), with their own run-time dependencies that the image lacks. `requires_check` below verifies the closure.
WHEELS=(
  maxtext==0.2.5
  google-tunix==0.1.7
  flax==0.12.10
  optax==0.2.8
  orbax-checkpoint==0.12.8
  qwix==0.1.8
  grain==0.2.18
  array_record==0.8.6
  dm-tree==0.1.10
  drjax==0.2.1
  aqtp==0.9.0
  tokamax==0.0.17
  pathwaysutils==0.1.13
  tensorboardX==2.6.5
  omegaconf==2.4.0
  antlr4-python3-runtime==4.13.2
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0
  google_metrax==0.2.4
  clu==0.0.12
  einshape==1.0
  immutabledict==4.3.1
  ml_collections==1.1.0
  more-itertools==11.2.1
  simple-parsing==0.1.9
  docstring-parser==0.18.0
  kagglehub==0.3.13
  jsonlines==4.0.0
  # Imported at import time by MaxText/Tunix/pathwaysutils/tokamax/grain/tensorboardX (traced in the CPU venv;
  # versions are that venv's): MaxText's config types, GCS clients, pathwaysutils' profiling server, xprof.
  pydantic==2.14.4
  pydantic_core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  xprof==2.24.2
  fire==0.7.1
  termcolor==3.3.0
  portpicker==1.6.0
  perfetto==0.59.1
  google-cloud-storage==3.17.1
  google-cloud-storage-control==1.17.0
  google-cloud-core==2.8.0
  google-api-core==2.44.0
  google-auth==2.63.0
  google-resumable-media==2.11.0
  google-crc32c==1.9.0
  googleapis-common-protos==1.76.0
  grpc-google-iam-v1==0.14.6
  grpcio-status==1.85.3
  proto-plus==1.29.0
  opentelemetry-api==1.45.2
  cryptography==50.0.2
  cffi==2.1.1
  pycparser==3.12
  pyasn1==0.6.5
  pyasn1_modules==0.4.2
)
# MaxText's assets/ are tokenizers of every model family (two thirds of its 13 MiB wheel); the benchmarks and the
# demo read only these (configs/cpu_tiny.yml's tokenizer_path; the demo ships its own). The whole wheel set fits the
# device tool's 64 MiB, so the others are dropped only when it does not (or STRIP_ASSETS=1).
KEEP_ASSETS=("maxtext/assets/tokenizers/qwen3-tokenizer/")

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"
  norm="$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')"
  if ls "$DEST" | tr 'A-Z' 'a-z' | grep -q "^${norm}-${spec##*==}-"; then continue; fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$DEST" "$spec"
done

size_b() { du -cb "$DEST"/*.whl | tail -1 | cut -f1; }
if [ "${STRIP_ASSETS:-0}" = 1 ] || [ "$(size_b)" -gt $((LIMIT_MIB * 1048576)) ]; then
# Strip MaxText's unused assets in place (RECORD rewritten to match, so pip's hash check still holds).
"$PY" - "$DEST" "${KEEP_ASSETS[@]}" <<'EOF'
import glob, os, sys, zipfile
dest, keep = sys.argv[1], tuple(sys.argv[2:])
for whl in glob.glob(os.path.join(dest, "maxtext-*.whl")):
  with zipfile.ZipFile(whl) as z:
    drop = {n for n in z.namelist() if n.startswith("maxtext/assets/") and not n.startswith(keep)}
    if not drop:
      continue
    tmp = whl + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
      for info in z.infolist():
        if info.filename in drop:
          continue
        data = z.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
          data = b"".join(l for l in data.splitlines(True) if l.split(b",")[0].decode() not in drop)
        out.writestr(info, data)
  os.replace(tmp, whl)
  print(f"stripped {len(drop)} unused asset files from {os.path.basename(whl)}")
EOF
fi

total=$(size_b)
ls -S -l "$DEST"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}' | sed "s|$DEST/||"
echo "total $(awk -v b="$total" 'BEGIN{printf "%.2f", b / 1048576}') MiB in $(ls "$DEST"/*.whl | wc -l) wheels (limit ${LIMIT_MIB} MiB)"
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "error: .whl/ is over ${LIMIT_MIB} MiB: the device tool carries 64 MiB per call, the repo included" >&2
  exit 1
fi
