# hstu_server (issue 4): gRPC front end, scheduler, metrics. The serving core (scheduler) and the
# metrics registry have no gRPC types, so tests use them directly.

add_library(hstu_server_core STATIC scheduler.cc prom_registry.cc)
target_link_libraries(hstu_server_core PUBLIC hstu_engine absl::status absl::statusor absl::span
                      absl::strings Threads::Threads)

add_library(hstu_server_lib STATIC metrics.cc http_exposer.cc validation.cc rank_service.cc
            ranking_server.cc stop_signals.cc)
target_link_libraries(hstu_server_lib PUBLIC hstu_server_core hstu_proto hstu_engine
                      hstu_grpc_reflection absl::time spdlog::spdlog)

add_executable(hstu_server main.cc flags.cc)
target_link_libraries(hstu_server PRIVATE hstu_server_lib absl::flags absl::flags_parse
                      absl::flags_usage)
