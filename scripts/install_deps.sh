#!/usr/bin/env bash
# Installs the build and test dependencies from Debian 12 packages, and the pinned CUTLASS headers
# (PyPI wheel `nvidia-cutlass`, headers only) into third_party/cutlass (git-ignored).
# Idempotent: packages already present are skipped by apt; safe to run on every CI run.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-pip curl
  python3-numpy
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev
  libopenblas-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libssl-dev
  prometheus-cpp-dev
  prometheus
)

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install_deps] installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[install_deps] all Debian packages present"
fi

# CUTLASS/CuTe headers for the CUDA kernels: the pinned PyPI wheel, headers only.
CUTLASS_VERSION="4.2.0.0"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/third_party/cutlass"
if [ "${HSTU_SKIP_CUTLASS:-0}" != "1" ] && [ ! -f "$DEST/include/cute/tensor.hpp" ]; then
  echo "[install_deps] fetching nvidia-cutlass==$CUTLASS_VERSION headers"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # Extracted into a folder beside DEST, then renamed into place: an interrupted run leaves no
  # partial include/ that a later run would take for a whole one.
  if python3 -m pip download --quiet --no-deps "nvidia-cutlass==$CUTLASS_VERSION" -d "$tmp" &&
     rm -rf "$DEST.partial" && mkdir -p "$DEST.partial" &&
     python3 - "$tmp"/nvidia_cutlass-*.whl "$DEST.partial" <<'PY'
import sys, zipfile, os
whl, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            out = os.path.join(dest, "include", n[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(z.read(n))
PY
  then
    rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
  else
    rm -rf "$DEST.partial"
    echo "[install_deps] warning: could not fetch CUTLASS headers (CUDA kernels that need them are skipped)"
  fi
  rm -rf "$tmp"
  trap - EXIT
fi
# numpy for the independent Python reference used by the tests (Debian's python3-numpy above; pip
# where python3 is not Debian's).
python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet numpy
echo "[install_deps] done"
