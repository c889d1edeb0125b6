# The wire contract compiled for C++ (issue 4): hstu_proto holds hstu/v1/ranking and the standard
# grpc.health.v1 client stubs. gRPC comes from Debian 12 (1.51); its CMake package works there but
# warns about c-ares, so pkg-config is the fallback when the package is absent.
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG QUIET)
if(gRPC_FOUND)
  set(HSTU_GRPCXX_LIBS gRPC::grpc++)
  set(HSTU_GRPCXX_REFLECTION_LIBS gRPC::grpc++_reflection)
else()
  find_package(PkgConfig REQUIRED)
  pkg_check_modules(HSTU_GRPCXX REQUIRED IMPORTED_TARGET grpc++)
  find_library(HSTU_GRPCXX_REFLECTION grpc++_reflection REQUIRED)
  set(HSTU_GRPCXX_LIBS PkgConfig::HSTU_GRPCXX)
  set(HSTU_GRPCXX_REFLECTION_LIBS ${HSTU_GRPCXX_REFLECTION})
endif()
find_program(HSTU_PROTOC protoc REQUIRED)
find_program(HSTU_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

set(_hstu_proto_out ${CMAKE_BINARY_DIR}/proto_gen)
file(MAKE_DIRECTORY ${_hstu_proto_out})
set(_hstu_proto_srcs)
set(_hstu_reflection_srcs)
foreach(_p hstu/v1/ranking grpc/health/v1/health grpc/reflection/v1alpha/reflection_client)
  set(_in ${CMAKE_CURRENT_SOURCE_DIR}/${_p}.proto)
  set(_outs ${_hstu_proto_out}/${_p}.pb.cc ${_hstu_proto_out}/${_p}.pb.h
            ${_hstu_proto_out}/${_p}.grpc.pb.cc ${_hstu_proto_out}/${_p}.grpc.pb.h)
  add_custom_command(
    OUTPUT ${_outs}
    COMMAND ${HSTU_PROTOC} --proto_path=${CMAKE_CURRENT_SOURCE_DIR} --cpp_out=${_hstu_proto_out}
            --grpc_out=${_hstu_proto_out} --plugin=protoc-gen-grpc=${HSTU_GRPC_CPP_PLUGIN} ${_in}
    DEPENDS ${_in}
    COMMENT "protoc ${_p}.proto"
    VERBATIM)
  if(_p MATCHES "reflection")
    list(APPEND _hstu_reflection_srcs ${_outs})
  else()
    list(APPEND _hstu_proto_srcs ${_outs})
  endif()
endforeach()

add_library(hstu_proto STATIC ${_hstu_proto_srcs})
# Generated code is not ours to warn about.
target_compile_options(hstu_proto PRIVATE -w)
target_include_directories(hstu_proto PUBLIC ${_hstu_proto_out})
target_link_libraries(hstu_proto PUBLIC protobuf::libprotobuf ${HSTU_GRPCXX_LIBS})

# Imported targets are scoped to this directory; the server links reflection through this one.
add_library(hstu_grpc_reflection INTERFACE)
target_link_libraries(hstu_grpc_reflection INTERFACE ${HSTU_GRPCXX_REFLECTION_LIBS})

# Reflection client stubs for tests only (never linked together with hstu_grpc_reflection).
add_library(hstu_reflection_client_proto STATIC ${_hstu_reflection_srcs})
target_compile_options(hstu_reflection_client_proto PRIVATE -w)
target_link_libraries(hstu_reflection_client_proto PUBLIC hstu_proto)
