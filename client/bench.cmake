# hstu_bench (GPU benchmarks, DESIGN §11); only with the CUDA backend.
if(TARGET hstu_engine_cuda)
  add_executable(hstu_bench ${CMAKE_CURRENT_LIST_DIR}/hstu_bench.cc
                 ${CMAKE_CURRENT_LIST_DIR}/bench_attention_layer.cc
                 ${CMAKE_CURRENT_LIST_DIR}/bench_engine.cc
                 ${CMAKE_CURRENT_LIST_DIR}/bench_gemm.cc
                 ${CMAKE_CURRENT_LIST_DIR}/bench_gemm_search.cc
                 ${CMAKE_CURRENT_LIST_DIR}/kernel_timeline.cc
                 ${CMAKE_CURRENT_LIST_DIR}/gpu_monitor.cc)
  target_link_libraries(hstu_bench PRIVATE hstu_engine hstu_engine_cuda hstu_kernels_cuda
                        absl::flags absl::flags_parse absl::flags_usage absl::str_format
                        nlohmann_json::nlohmann_json CUDA::cupti ${CMAKE_DL_LIBS})
endif()
