# Compile settings for qkv's own tests, benchmarks and examples. Never applied to qkv::qkv: a library must not
# choose its users' warning level or instruction set.
#
#   qkv_target_defaults(<target>)
#
# compiles <target> as exactly ISO C++17 (-std=c++17: no GNU extensions, and no newer default standard that would
# hide C++20-isms such as designated initializers), adds -Wall -Wextra -Wpedantic -Werror and, when the cache variable
# QKV_ARCH is not empty, -march=${QKV_ARCH} (set by the presets: native, x86-64, x86-64-v3, x86-64-v4). Use -march
# levels, never a bare -mavx512f: GCC 12 then lacks __FMA__ and Eigen refuses to build (STYLE.md, Build). When the
# cache variable QKV_ISA is set (scalar, avx2, avx512), it pins the fused kernel's ISA where the environment variable
# QKV_ISA does not (isa.hpp: QKV_ISA_DEFAULT).
include_guard(GLOBAL)

function(qkv_target_defaults target)
  set_target_properties(${target} PROPERTIES CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Werror)
    if(QKV_ARCH)
      target_compile_options(${target} PRIVATE -march=${QKV_ARCH})
    endif()
    if(QKV_ISA)
      target_compile_definitions(${target} PRIVATE QKV_ISA_DEFAULT="${QKV_ISA}")
    endif()
  elseif(MSVC)
    target_compile_options(${target} PRIVATE /W4 /WX)
  endif()
endfunction()
