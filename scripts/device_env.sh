# Sourced on the GPU machine: unpacks a pack and puts its libraries and the machine's CUDA 13
# libraries (toolkit, else PyTorch's pip wheels) on LD_LIBRARY_PATH.
#   unpack_and_setup PACK.tar.gz DIR   → sets H=DIR/<top folder of the pack>; returns 1 (saying why)
#   when the pack is missing or does not unpack to a folder with bin/
unpack_and_setup() {
  local pack="$1" dir="$2" top
  [ -f "$pack" ] || { echo "unpack_and_setup: no pack at $pack" >&2; return 1; }
  rm -rf "$dir" && mkdir -p "$dir"
  tar -C "$dir" -xzf "$pack" || { echo "unpack_and_setup: $pack did not unpack" >&2; return 1; }
  top="$(tar -tzf "$pack" | head -1 | cut -d/ -f1)"
  H="$dir/$top"
  [ -n "$top" ] && [ -d "$H/bin" ] || { echo "unpack_and_setup: $pack has no <folder>/bin" >&2; return 1; }
  local cuda_lib=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13.0/lib64; do
    if [ -e "$d/libcublasLt.so.13" ]; then cuda_lib="$d"; break; fi
  done
  if [ -z "$cuda_lib" ]; then
    local cublas rt
    cublas="$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)"
    rt="$(python3 -c 'import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib"))' 2>/dev/null || true)"
    cuda_lib="$cublas${cublas:+${rt:+:}}$rt"
  fi
  CUDA_LIB="$cuda_lib"
  # No empty entries: an empty one means the current directory to the dynamic loader.
  export LD_LIBRARY_PATH="$H/lib${cuda_lib:+:$cuda_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# Sets CS to the machine's compute-sanitizer (PATH, else the toolkit's); returns 1 when none.
find_compute_sanitizer() {
  CS="$(command -v compute-sanitizer || true)"
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -z "$CS" ] && [ -x "$c" ] && CS="$c"
  done
  [ -n "$CS" ]
}
