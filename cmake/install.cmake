# What `cmake --install` puts where. Two layouts:
#  - a C/C++ installation (default): headers, libccalloc.a and libccalloc_{replay,cuda}.a
#    for C++ programs, libccalloc.so (the C API), the ccalloc tool, the CMake package
#    (find_package(ccalloc CONFIG)) and ccalloc.pc;
#  - a Python wheel (SKBUILD, set by scikit-build-core): only libccalloc.so,
#    libccalloc_torch.so (the native allocator) and, where it was built,
#    libccalloc_torch_hooks.so, and CuPy's C route (_ccalloc_cupy.abi3.so), inside the
#    ccalloc_torch package, which looks for them there.
include(CMakePackageConfigHelpers)

if(SKBUILD)
  if(NOT TARGET ccalloc_torch)
    message(FATAL_ERROR "ccalloc: the Python package needs libccalloc_torch.so, which was not "
                        "configured: it needs the CUDA toolkit and an importable torch with CUDA "
                        "(see the 'ccalloc:' lines above; CCALLOC_TORCH_PYTHON picks the Python)")
  endif()
  # torch's libraries are loaded by `import torch` before these; $ORIGIN finds libccalloc.so.
  get_target_property(ccalloc_torch_rpath ccalloc_torch BUILD_RPATH)
  set_target_properties(ccalloc_torch PROPERTIES INSTALL_RPATH "${ccalloc_torch_rpath}")
  install(TARGETS ccalloc_shared ccalloc_torch LIBRARY DESTINATION ccalloc_torch)
  if(TARGET ccalloc_cupy_route)  # CuPy's C route (bindings/cupy), where Python's headers were
    install(TARGETS ccalloc_cupy_route LIBRARY DESTINATION ccalloc_torch)
  endif()
  # Into site-packages itself, where Python runs it at every start: CCALLOC_ENABLE=1 then
  # installs ccalloc at the program's `import torch` (ccalloc_torch/_autoinstall.py).
  install(FILES ${PROJECT_SOURCE_DIR}/bindings/torch/ccalloc_torch.pth DESTINATION .)
  if(TARGET ccalloc_torch_hooks)  # the CUDAPluggableAllocator fallback, where it was built
    get_target_property(ccalloc_hooks_rpath ccalloc_torch_hooks BUILD_RPATH)
    set_target_properties(ccalloc_torch_hooks PROPERTIES INSTALL_RPATH "${ccalloc_hooks_rpath}")
    install(TARGETS ccalloc_torch_hooks LIBRARY DESTINATION ccalloc_torch)
  endif()
  return()
endif()

set(CCALLOC_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ccalloc)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ccalloc
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# libccalloc.a is the engine (ccalloc::engine); ccalloc::ccalloc adds trace/snapshot files
# (libccalloc_replay.a). libccalloc.so exports only the C API, with everything else linked
# into it privately.
install(TARGETS ccalloc ccalloc_replay ccalloc_package ccalloc_cuda ccalloc_shared
        EXPORT ccallocTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET ccalloc_cli)
  install(TARGETS ccalloc_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT ccallocTargets NAMESPACE ccalloc:: DESTINATION ${CCALLOC_CMAKE_DIR})

# The static libraries' private dependencies, which their users link: the package config
# finds them again.
if(CCALLOC_HAVE_LIBDW)
  set(CCALLOC_PACKAGE_LIBDW ON)
else()
  set(CCALLOC_PACKAGE_LIBDW OFF)
endif()
set(CCALLOC_PACKAGE_CUDA ${CCALLOC_HAVE_CUDA})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ccallocConfig.cmake.in
  ${PROJECT_BINARY_DIR}/ccallocConfig.cmake INSTALL_DESTINATION ${CCALLOC_CMAKE_DIR})
# 0.x: a minor version may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ccallocConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ccallocConfig.cmake
              ${PROJECT_BINARY_DIR}/ccallocConfigVersion.cmake
        DESTINATION ${CCALLOC_CMAKE_DIR})

# pkg-config: the C API in libccalloc.so. The prefix is found relative to the .pc file, so
# the tree can be installed anywhere (cmake --install --prefix).
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(CCALLOC_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH ccalloc_pc_up "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
  string(REGEX REPLACE "/$" "" ccalloc_pc_up "${ccalloc_pc_up}")
  set(CCALLOC_PC_PREFIX "\${pcfiledir}/${ccalloc_pc_up}")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/ccalloc.pc.in ${PROJECT_BINARY_DIR}/ccalloc.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ccalloc.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
