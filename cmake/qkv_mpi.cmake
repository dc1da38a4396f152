# How qkv's own MPI programs run under the MPI launcher (tests/mpi/, examples/ring_attention.cpp). Included by the
# top-level CMakeLists.txt when QKV_MPI is ON, after find_package(MPI).
#
#   qkv_add_mpi_test(<name> <ranks> <command> [<argument>...])
#
# registers a ctest entry that runs <command> under ${MPIEXEC_EXECUTABLE} with <ranks> processes, label `mpi`, one
# OpenMP thread per rank (OMP_NUM_THREADS=1: the tests oversubscribe two cores with up to four ranks) and a timeout, so
# that a rank left waiting fails the test instead of hanging it. With Open MPI the launcher also gets
# QKV_MPIEXEC_FLAGS (default: --oversubscribe, so that more ranks than cores may run, and --allow-run-as-root, since CI
# runs as root); other launchers get only MPIEXEC_PREFLAGS.
include_guard(GLOBAL)

set(qkv_mpiexec_default_flags "")
if(NOT DEFINED CACHE{QKV_MPIEXEC_FLAGS} AND MPIEXEC_EXECUTABLE)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE qkv_mpiexec_version ERROR_QUIET
                  RESULT_VARIABLE qkv_mpiexec_result TIMEOUT 30)
  if(qkv_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(qkv_mpiexec_default_flags "--oversubscribe;--allow-run-as-root")
  endif()
endif()
set(QKV_MPIEXEC_FLAGS "${qkv_mpiexec_default_flags}" CACHE STRING
    "Flags qkv's own MPI tests pass to mpiexec before the program (a list; Open MPI: --oversubscribe;--allow-run-as-root)")
set(QKV_MPI_TEST_TIMEOUT 300 CACHE STRING "Timeout in seconds of each of qkv's MPI test runs (a hang fails, never waits)")

function(qkv_add_mpi_test name ranks command)
  add_test(NAME ${name}
    COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${QKV_MPIEXEC_FLAGS} ${MPIEXEC_PREFLAGS} ${command}
            ${ARGN} ${MPIEXEC_POSTFLAGS})
  set_tests_properties(${name} PROPERTIES LABELS mpi TIMEOUT ${QKV_MPI_TEST_TIMEOUT} ENVIRONMENT OMP_NUM_THREADS=1)
endfunction()
