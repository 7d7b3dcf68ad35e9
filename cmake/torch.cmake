# Finds the LibTorch that Caravan builds against, for the main build and fuzz/: the one inside
# the torch wheel of the project's virtual environment. Sets CARAVAN_PYTHON, CARAVAN_TORCH_DIR,
# the Torch package's variables (TORCH_LIBRARIES, TORCH_CXX_FLAGS), and the include
# directories that must come before the wheel's: CARAVAN_FMT_SHIM, CARAVAN_GLOO_INCLUDE.
get_filename_component(CARAVAN_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)

# LibTorch: the one inside the torch wheel (torch==2.13.0, CPU) of the project's virtual
# environment, .venv (scripts/setup.sh makes it), whose Python also runs the oracles and peers.
# Another environment: -DCARAVAN_PYTHON=<its python>. Debian's LibTorch 1.13 is never used.
set(CARAVAN_TORCH_VERSION 2.13.0)
set(CARAVAN_PYTHON "${CARAVAN_ROOT}/.venv/bin/python" CACHE FILEPATH
    "The project's Python, with torch==${CARAVAN_TORCH_VERSION} (its LibTorch is built against)")
# The torch that CARAVAN_PYTHON imports, asked of that Python (not globbed: a venv rebuilt for
# another Python version keeps the old site-packages beside the new).
execute_process(
  COMMAND "${CARAVAN_PYTHON}" -c "import os, torch; print(os.path.dirname(torch.__file__))"
  OUTPUT_VARIABLE CARAVAN_TORCH_DIR RESULT_VARIABLE caravanTorchFound
  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT caravanTorchFound EQUAL 0 OR NOT IS_DIRECTORY "${CARAVAN_TORCH_DIR}")
  message(FATAL_ERROR "${CARAVAN_PYTHON} cannot import torch: run `bash scripts/setup.sh` (it "
                      "makes .venv with torch==${CARAVAN_TORCH_VERSION}), or pass "
                      "-DCARAVAN_PYTHON=<a python whose environment has it>")
endif()
get_filename_component(CARAVAN_TORCH_DIR "${CARAVAN_TORCH_DIR}" REALPATH)
# First in the prefix path, and the package directories forced, so that every library comes from
# the wheel: never from a system LibTorch (Debian's libtorch-dev) that find_library would see
# first, nor from a Caffe2_DIR that a build directory configured before kept in its cache.
unset(ENV{TORCH_INSTALL_PREFIX})
list(PREPEND CMAKE_PREFIX_PATH "${CARAVAN_TORCH_DIR}")
set(Torch_DIR "${CARAVAN_TORCH_DIR}/share/cmake/Torch" CACHE PATH "" FORCE)
set(Caffe2_DIR "${CARAVAN_TORCH_DIR}/share/cmake/Caffe2" CACHE PATH "" FORCE)
foreach(cached TORCH_LIBRARY c10_LIBRARY kineto_LIBRARY)
  if(DEFINED CACHE{${cached}})
    string(FIND "${${cached}}" "${CARAVAN_TORCH_DIR}/" at)
    if(NOT at EQUAL 0)
      unset(${cached} CACHE)
    endif()
  endif()
endforeach()
find_package(Torch REQUIRED)
if(NOT Torch_VERSION VERSION_EQUAL CARAVAN_TORCH_VERSION)
  message(FATAL_ERROR "found LibTorch ${Torch_VERSION} (${CARAVAN_TORCH_DIR}); Caravan needs "
                      "${CARAVAN_TORCH_VERSION}: run `bash scripts/setup.sh`, which installs "
                      "torch==${CARAVAN_TORCH_VERSION} into .venv")
endif()
# What is linked: the imported targets' files and the libraries' paths, all inside the wheel.
set(caravanTorchFiles ${TORCH_LIBRARY})
foreach(target torch torch_cpu c10)
  if(TARGET ${target})
    foreach(property IMPORTED_LOCATION IMPORTED_LOCATION_RELEASE)
      get_target_property(location ${target} ${property})
      if(location)
        list(APPEND caravanTorchFiles ${location})
      endif()
    endforeach()
  endif()
endforeach()
foreach(file ${caravanTorchFiles})
  string(FIND "${file}" "${CARAVAN_TORCH_DIR}/" at)
  if(NOT at EQUAL 0)
    message(FATAL_ERROR "LibTorch's library resolved to ${file}, not the wheel's "
                        "(${CARAVAN_TORCH_DIR}/lib): configure a fresh build directory")
  endif()
endforeach()
# The wheel's include/ carries fmt 12 headers; spdlog and libfmt are Debian's (fmt 9). A
# directory holding only Debian's fmt/ goes before the wheel's includes.
set(CARAVAN_FMT_SHIM ${CMAKE_BINARY_DIR}/fmt-include)
file(MAKE_DIRECTORY ${CARAVAN_FMT_SHIM})
file(CREATE_LINK /usr/include/fmt ${CARAVAN_FMT_SHIM}/fmt SYMBOLIC)
# Gloo: the copy compiled into libtorch_cpu is the only one in the process (c10d's
# ProcessGroupGloo, and bench_comm's raw Gloo arm, call it). The wheel ships no Gloo headers;
# third_party/gloo holds those of the Gloo commit that torch ${CARAVAN_TORCH_VERSION} pins, so
# that what is compiled here agrees with that copy (docs/architecture.md, "One Gloo").
set(CARAVAN_GLOO_INCLUDE ${CARAVAN_ROOT}/third_party/gloo)
