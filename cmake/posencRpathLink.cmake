# posenc_wheel_rpath_link(<torch lib dir> <out var>): the link option that makes an executable
# linking posenc resolve libtorch_cuda's dependencies in a pip-installed torch's own
# site-packages/nvidia/*/lib directories ("" where there are none, or off Linux). GNU ld,
# linking an executable, looks for a shared library's dependencies in the -rpath directories
# first, where a CUDA toolkit may keep an older NCCL: torch 2.15 with CUDA 13.0's NCCL failed
# with undefined nccl* symbols; -rpath-link is searched before them. Used by CMakeLists.txt
# for the build tree's targets and by posencConfig.cmake with the torch the application
# found (so the installed package holds no path of the machine that built it).
function(posenc_wheel_rpath_link torch_lib_dir out)
  set(result "")
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    file(GLOB dirs LIST_DIRECTORIES true "${torch_lib_dir}/../../nvidia/*/lib")
    if(dirs)
      list(JOIN dirs ":" path)
      set(result "-Wl,-rpath-link,${path}")
    endif()
  endif()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()
