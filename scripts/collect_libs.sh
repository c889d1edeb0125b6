#!/usr/bin/env bash
# collect_libs.sh DEST BINARY...: copies every shared library the binaries need into DEST, except
# glibc, the C++ runtime and the CUDA toolkit's (the GPU machine has its own CUDA 13.0 stack).
set -euo pipefail
DEST="$1"
shift
mkdir -p "$DEST"
LDD="$(for b in "$@"; do ldd "$b"; done)"
# A library this machine lacks cannot be packed: say which (the GPU machine would lack it too).
missing="$(grep 'not found' <<< "$LDD" | awk '{print $1}' | sort -u || true)"
if [ -n "$missing" ]; then
  echo "collect_libs.sh: libraries not found here: $missing" >&2
  exit 1
fi
awk '/=>/ {print $3}' <<< "$LDD" | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libmvec.so*|libstdc++.so*|libgcc_s.so*|libdl.so*|libpthread.so*|librt.so*|\
    libutil.so*|libresolv.so*|libanl.so*|libnsl.so*|ld-linux*|\
    libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*) continue ;;
  esac
  cp -L "$lib" "$DEST/"
done
