# CMake 3.25 knows no C++20 flag for nvcc (its NVIDIA-CUDA module stops at CUDA17), so
# CMAKE_CUDA_STANDARD 20 fails in enable_language(CUDA). Pass this file as
# -DCMAKE_USER_MAKE_RULES_OVERRIDE_CUDA=<path> (or set that variable before enable_language).
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
