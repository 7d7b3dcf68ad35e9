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
get_filename_component(CARAVAN_PYTHON_ENV "${CARAVAN_PYTHON}" DIRECTORY)  # .venv/bin
get_filename_component(CARAVAN_PYTHON_ENV "${CARAVAN_PYTHON_ENV}" DIRECTORY)
file(GLOB CARAVAN_TORCH_DIR LIST_DIRECTORIES true
  "${CARAVAN_PYTHON_ENV}/lib/python3*/site-packages/torch")
if(NOT CARAVAN_TORCH_DIR)
  message(FATAL_ERROR "no torch next to ${CARAVAN_PYTHON}: run `bash scripts/setup.sh` (it makes "
                      ".venv with torch==${CARAVAN_TORCH_VERSION}), or pass -DCARAVAN_PYTHON=<a "
                      "python whose environment has it>")
endif()
list(GET CARAVAN_TORCH_DIR 0 CARAVAN_TORCH_DIR)
get_filename_component(CARAVAN_TORCH_DIR "${CARAVAN_TORCH_DIR}" REALPATH)
# First in the prefix path, so that TorchConfig's libraries come from the wheel, never from a
# system LibTorch (Debian's libtorch-dev) that find_library would otherwise see first.
list(PREPEND CMAKE_PREFIX_PATH "${CARAVAN_TORCH_DIR}")
set(Torch_DIR "${CARAVAN_TORCH_DIR}/share/cmake/Torch" CACHE PATH "" FORCE)
find_package(Torch REQUIRED)
if(NOT Torch_VERSION VERSION_EQUAL CARAVAN_TORCH_VERSION)
  message(FATAL_ERROR "found LibTorch ${Torch_VERSION} (${CARAVAN_TORCH_DIR}); Caravan needs "
                      "${CARAVAN_TORCH_VERSION}: run `bash scripts/setup.sh`, which installs "
                      "torch==${CARAVAN_TORCH_VERSION} into .venv")
endif()
if(NOT TORCH_LIBRARY MATCHES "^${CARAVAN_TORCH_DIR}/")
  message(FATAL_ERROR "LibTorch's library resolved to ${TORCH_LIBRARY}, not the wheel's "
                      "(${CARAVAN_TORCH_DIR}/lib): remove the other LibTorch from the prefix path")
endif()
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
