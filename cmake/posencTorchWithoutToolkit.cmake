# find_package(Torch) for a CUDA build of torch on a machine without the CUDA toolkit.
#
# Included before find_package(Torch) by posenc's CMakeLists.txt and by its installed CMake
# package (posencConfig.cmake). PyPI's Linux torch and the CUDA LibTorch downloads are CUDA
# builds: their Caffe2Config.cmake runs public/cuda.cmake, which looks for nvcc and the
# toolkit's headers and, without them, stops the configure ("Your installed Caffe2 version
# uses CUDA but I cannot find the CUDA libraries"). Code that only calls torch's C++ API,
# like posenc's CPU build or a LibTorch app, needs none of it: torch's libraries carry their
# own CUDA runtime (site-packages/nvidia/*/lib, libtorch/lib) and find it through their own
# RUNPATH. cuda.cmake returns at once when the target torch::cudart exists (its include
# guard), and torch::cudart is the one CUDA target that torch's exported targets (c10_cuda,
# torch_cuda) reference. So when no toolkit is found, this file defines torch::cudart as an
# empty interface: libtorch_cuda and libc10_cuda are still linked, and they bring
# libcudart at run time. With a toolkit, torch's cuda.cmake runs as it always has.
#
# Sets POSENC_TORCH_WITHOUT_TOOLKIT to TRUE when it defined the stand-in.
set(POSENC_TORCH_WITHOUT_TOOLKIT FALSE)
if(NOT TARGET torch::cudart)
  if(DEFINED CMAKE_CUDA_COMPILER)
    # check_language(CUDA) ran (posenc's own build): it ran the compiler it found.
    set(_posenc_toolkit_nvcc "${CMAKE_CUDA_COMPILER}")
  elseif(DEFINED ENV{CUDACXX} AND EXISTS "$ENV{CUDACXX}")
    set(_posenc_toolkit_nvcc "$ENV{CUDACXX}")
  else()
    # Where torch's FindCUDA looks for nvcc: the toolkit variables, PATH, /usr/local/cuda.
    # Only an executable nvcc counts (CMP0109 NEW, whatever the including project's policy:
    # under OLD a readable non-executable file, e.g. one masked by /dev/null, was taken).
    cmake_policy(PUSH)
    if(POLICY CMP0109)
      cmake_policy(SET CMP0109 NEW)
    endif()
    find_program(_posenc_toolkit_nvcc nvcc
      HINTS ENV CUDA_HOME ENV CUDA_PATH ENV CUDA_TOOLKIT_ROOT ENV CUDA_BIN_PATH
            "${CUDA_TOOLKIT_ROOT_DIR}" "${CUDAToolkit_ROOT}"
      PATH_SUFFIXES bin
      PATHS /usr/local/cuda/bin
      NO_CACHE)
    cmake_policy(POP)
  endif()
  if(NOT _posenc_toolkit_nvcc)
    add_library(torch::cudart INTERFACE IMPORTED)
    set(POSENC_TORCH_WITHOUT_TOOLKIT TRUE)
    message(STATUS "posenc: no CUDA toolkit (nvcc) found; a CUDA build of torch is used "
                   "through its libraries only (torch::cudart stands in for the toolkit's cudart)")
  endif()
  unset(_posenc_toolkit_nvcc)
endif()
