# hstu_server (issue 4): gRPC front end, scheduler, metrics. The serving core (the scheduler) has
# no gRPC types, so tests use it directly.

# prometheus-cpp's core library (Debian's prometheus-cpp-dev): the metric families and the text
# format. Its pull library is not used (server/http_exposer.h says why); the package's CMake config
# also requires the pull and push libraries' dependencies, so the core is found by pkg-config.
find_package(PkgConfig REQUIRED)
pkg_check_modules(HSTU_PROMETHEUS REQUIRED IMPORTED_TARGET prometheus-cpp-core>=1.0)

add_library(hstu_server_core STATIC scheduler.cc)
target_link_libraries(hstu_server_core PUBLIC hstu_engine absl::status absl::statusor absl::span
                      absl::strings Threads::Threads)

# TLS for the gRPC port (server) and for gRPC clients (hstu_loadgen, tests): OpenSSL checks the
# PEM files at start-up, gRPC serves them.
find_package(OpenSSL REQUIRED)
add_library(hstu_tls STATIC tls.cc)
target_link_libraries(hstu_tls PUBLIC hstu_proto absl::status absl::statusor absl::strings spdlog::spdlog
                      absl::time PRIVATE OpenSSL::SSL OpenSSL::Crypto)
target_include_directories(hstu_tls PUBLIC ${CMAKE_SOURCE_DIR})

# gRPC core's log lines through spdlog, rate-limited per source line (grpc_log.h): gpr_log and
# gpr_set_log_function are libgpr's, which grpc++'s pkg-config entry links only privately.
pkg_check_modules(HSTU_GPR REQUIRED IMPORTED_TARGET gpr)
add_library(hstu_grpc_log STATIC grpc_log.cc)
target_link_libraries(hstu_grpc_log PUBLIC PkgConfig::HSTU_GPR absl::time spdlog::spdlog)
target_include_directories(hstu_grpc_log PUBLIC ${CMAKE_SOURCE_DIR})

# The log lines as JSON (--log_format=json).
add_library(hstu_log_format STATIC log_format.cc)
target_link_libraries(hstu_log_format PUBLIC absl::status absl::strings spdlog::spdlog)
target_include_directories(hstu_log_format PUBLIC ${CMAKE_SOURCE_DIR})

add_library(hstu_server_lib STATIC metrics.cc prom_family.cc http_exposer.cc validation.cc
            rank_service.cc ranking_server.cc request_log.cc stop_signals.cc)
target_link_libraries(hstu_server_lib PUBLIC hstu_server_core hstu_proto hstu_engine
                      hstu_grpc_reflection hstu_grpc_log hstu_log_format hstu_tls absl::time spdlog::spdlog PkgConfig::HSTU_PROMETHEUS
                      PRIVATE OpenSSL::SSL OpenSSL::Crypto)

add_executable(hstu_server main.cc flags.cc)
target_link_libraries(hstu_server PRIVATE hstu_server_lib hstu_grpc_log hstu_log_format absl::flags absl::flags_parse
                      absl::flags_usage)
