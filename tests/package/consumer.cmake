# Shared by the three consumer projects of tests/package/ (include()d after qkv is available).
#
#   qkv_package_check_target(<qkv target>)   see below
#
#   qkv_package_consumer(<executable> <qkv target>)
#
# builds consumer_main.cpp as <executable> linked to <qkv target> (qkv::qkv or qkv::qkv_serial), with the warnings of
# a strict user (-Wall -Wextra -Wpedantic -Werror) and no ISA flag, and installs it (bin/), so that run.sh can check
# what `cmake --install` of the consumer puts in its prefix. First checks what a user relies on: the target exists
# and carries no -march; then tells the program what to expect of OpenMP (checked at compile time and printed):
# qkv::qkv_serial never gives _OPENMP; qkv::qkv gives it when it links OpenMP::OpenMP_CXX.
include_guard(GLOBAL)
set(QKV_PACKAGE_DIR ${CMAKE_CURRENT_LIST_DIR})

#   qkv_package_check_target(<qkv target>)
#
# only the configure-time checks (the target exists, no -march, qkv::qkv_serial links no OpenMP), for a target the
# project does not build a program against.
function(qkv_package_check_target target)
  if(NOT TARGET ${target})
    message(FATAL_ERROR "qkv consumer: target ${target} does not exist")
  endif()
  get_target_property(options ${target} INTERFACE_COMPILE_OPTIONS)
  if(options MATCHES "march")
    message(FATAL_ERROR "qkv consumer: ${target} carries an ISA flag: ${options}")
  endif()
  get_target_property(libraries ${target} INTERFACE_LINK_LIBRARIES)
  if(target STREQUAL "qkv::qkv_serial" AND libraries MATCHES "OpenMP")
    message(FATAL_ERROR "qkv consumer: qkv::qkv_serial links OpenMP: ${libraries}")
  endif()
  message(STATUS "qkv consumer: ${target} links ${libraries}")
endfunction()

function(qkv_package_consumer executable target)
  qkv_package_check_target(${target})
  get_target_property(libraries ${target} INTERFACE_LINK_LIBRARIES)

  add_executable(${executable} ${QKV_PACKAGE_DIR}/consumer_main.cpp)
  target_link_libraries(${executable} PRIVATE ${target})
  target_compile_options(${executable} PRIVATE -Wall -Wextra -Wpedantic -Werror)
  target_compile_definitions(${executable} PRIVATE QKV_CONSUMER_TARGET="${target}")
  if(target STREQUAL "qkv::qkv_serial")
    target_compile_definitions(${executable} PRIVATE QKV_CONSUMER_EXPECT_SERIAL)
  elseif(libraries MATCHES "OpenMP")
    target_compile_definitions(${executable} PRIVATE QKV_CONSUMER_EXPECT_OPENMP)
  endif()
  install(TARGETS ${executable} RUNTIME DESTINATION bin)
endfunction()
