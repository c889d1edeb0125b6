# The CUDA backend (included by engine/CMakeLists.txt when HSTU_ENABLE_CUDA is on).
add_library(hstu_engine_cuda ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cc
            ${CMAKE_CURRENT_LIST_DIR}/cuda_host_tier.cc
            ${CMAKE_CURRENT_LIST_DIR}/graph_runner.cc ${CMAKE_SOURCE_DIR}/kernels/cuda/copy_pages.cc)
target_include_directories(hstu_engine_cuda PUBLIC ${CMAKE_SOURCE_DIR})
target_link_libraries(hstu_engine_cuda PUBLIC hstu_kernels_cuda CUDA::cudart CUDA::cublas
                      CUDA::cublasLt absl::status absl::statusor absl::strings spdlog::spdlog)
