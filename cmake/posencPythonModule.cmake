# posenc._C (csrc/python/fast_calls.cpp): the one piece of posenc built against Python's C
# API, a direct entry for the modules' decode call beside torch.ops (issue 28). It is a
# Python extension module (one file per Python version, like torch._C), built beside
# libposenc and copied with it; it does not link libposenc (it finds the op in the
# dispatcher by name), only torch's libraries and libtorch_python. The package runs without
# it (posenc._library.FAST_CALLS is then None and the modules call torch.ops), so a machine
# without Python's headers still builds libposenc: POSENC_PYTHON_MODULE=AUTO (default)
# builds it when the interpreter's headers and libtorch_python are found, ON requires them,
# OFF skips it.
set(POSENC_PYTHON_MODULE "AUTO" CACHE STRING "Build posenc._C: AUTO, ON or OFF")
string(TOUPPER "${POSENC_PYTHON_MODULE}" POSENC_PYTHON_MODULE)
set(_posenc_python_module OFF)
if(NOT POSENC_PYTHON_MODULE STREQUAL "OFF" AND Python3_EXECUTABLE)
  find_package(Python3 COMPONENTS Interpreter Development.Module)
  find_library(POSENC_TORCH_PYTHON_LIBRARY torch_python PATHS "${POSENC_TORCH_LIB_DIR}" NO_DEFAULT_PATH)
  if(Python3_Development.Module_FOUND AND POSENC_TORCH_PYTHON_LIBRARY)
    set(_posenc_python_module ON)
  endif()
endif()
if(POSENC_PYTHON_MODULE STREQUAL "ON" AND NOT _posenc_python_module)
  message(FATAL_ERROR "POSENC_PYTHON_MODULE=ON but Python's headers (Development.Module of "
    "${Python3_EXECUTABLE}) or libtorch_python (in ${POSENC_TORCH_LIB_DIR}) were not found")
endif()
message(STATUS "posenc: Python module posenc._C: ${_posenc_python_module}")

if(_posenc_python_module)
  # Python3_add_library gives the module its name (_C.cpython-311-x86_64-linux-gnu.so) and
  # leaves libpython unlinked (the interpreter provides it).
  # Its output directory is libposenc's (CMAKE_LIBRARY_OUTPUT_DIRECTORY, or this build's).
  Python3_add_library(posenc_python MODULE WITH_SOABI csrc/python/fast_calls.cpp)
  set_target_properties(posenc_python PROPERTIES
    OUTPUT_NAME _C
    CXX_VISIBILITY_PRESET hidden
    INSTALL_RPATH "${POSENC_INSTALL_RPATH}"
    BUILD_WITH_INSTALL_RPATH ON)
  target_include_directories(posenc_python PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
  target_link_libraries(posenc_python PRIVATE ${TORCH_LIBRARIES} ${POSENC_TORCH_PYTHON_LIBRARY})
  target_compile_options(posenc_python PRIVATE -Wall -Wno-unused-parameter)
  # Built with the library (make build, the wheel), not only on request.
  add_dependencies(posenc posenc_python)
  if(POSENC_INSTALL_PYTHON_LIB)
    add_custom_command(TARGET posenc_python POST_BUILD
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_SOURCE_DIR}/python/posenc/lib
      COMMAND ${CMAKE_COMMAND} -E copy $<TARGET_FILE:posenc_python>
              ${CMAKE_CURRENT_SOURCE_DIR}/python/posenc/lib/
      COMMENT "Copying posenc._C into python/posenc/lib")
  endif()
endif()
