# hstu_loadgen (issue 4): closed/open-loop load against hstu_server over gRPC.
add_library(hstu_loadgen_lib STATIC traffic.cc replay.cc latency_histogram.cc report.cc
            answer_log.cc stop_signal.cc)
target_link_libraries(hstu_loadgen_lib PUBLIC hstu_request_line hstu_atomic_file absl::status absl::statusor
                      absl::strings absl::str_format nlohmann_json::nlohmann_json)

add_executable(hstu_loadgen loadgen_main.cc load_driver.cc)
target_link_libraries(hstu_loadgen PRIVATE hstu_loadgen_lib hstu_atomic_file hstu_proto hstu_tls absl::flags
                      absl::flags_parse absl::flags_usage Threads::Threads)
