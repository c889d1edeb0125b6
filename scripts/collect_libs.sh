#!/usr/bin/env bash
# collect_libs.sh DEST BINARY...: copies every shared library the binaries need into DEST, except
# glibc, the C++ runtime and the CUDA toolkit's (the GPU machine has its own CUDA 13.0 stack).
set -euo pipefail
DEST="$1"
shift
mkdir -p "$DEST"
for b in "$@"; do ldd "$b"; done | awk '/=>/ {print $3}' | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|\
    libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*) continue ;;
  esac
  cp -L "$lib" "$DEST/"
done
