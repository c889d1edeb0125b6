# hstu_server (issue 4): gRPC front end, scheduler, metrics. The serving core (scheduler) and the
# metrics registry have no gRPC types, so tests use them directly.
find_path(HSTU_CIVETWEB_INCLUDE civetweb.h REQUIRED)
find_library(HSTU_CIVETWEB_LIB civetweb REQUIRED)
# Debian's civetweb CMake package names a /usr/bin/civetweb that the -dev package does not ship,
# so the plain header and library are used instead.

add_library(hstu_server_core STATIC scheduler.cc prom_registry.cc)
target_link_libraries(hstu_server_core PUBLIC hstu_engine absl::status absl::statusor absl::span
                      absl::strings Threads::Threads)

add_library(hstu_server_lib STATIC metrics.cc validation.cc rank_service.cc ranking_server.cc)
target_include_directories(hstu_server_lib PRIVATE ${HSTU_CIVETWEB_INCLUDE})
target_link_libraries(hstu_server_lib PUBLIC hstu_server_core hstu_proto hstu_engine
                      hstu_grpc_reflection ${HSTU_CIVETWEB_LIB} absl::time spdlog::spdlog)

add_executable(hstu_server main.cc flags.cc)
target_link_libraries(hstu_server PRIVATE hstu_server_lib absl::flags absl::flags_parse
                      absl::flags_usage)
