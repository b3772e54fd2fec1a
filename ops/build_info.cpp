// Schemas of hierpar::cuda_arch_list and hierpar::cuda_code_arch (what this build holds code for, and which of it a
// GPU runs) and their C++ entry points. They take no tensor, so each has one kernel for every dispatch key.
#include "hierpar/ops.h"

#ifdef HIERPAR_WITH_CUDA
#include "cuda/device_caps.h"
#endif

#include <c10/util/Exception.h>
#include <torch/library.h>

// CMake passes TORCH_CUDA_ARCH_LIST as it built this library (this file only, so that other files' compiler caches
// do not depend on it).
#ifndef HIERPAR_CUDA_ARCH_LIST
#define HIERPAR_CUDA_ARCH_LIST ""
#endif

namespace hierpar::ops {

std::string cuda_arch_list() { return HIERPAR_CUDA_ARCH_LIST; }

std::string cuda_code_arch(int64_t device) {
#ifdef HIERPAR_WITH_CUDA
  const auto& caps = detail::device_caps(device);
  const auto arch = [](int a) { return std::to_string(a); };
  return caps.code_from_ptx ? "compute_" + arch(caps.code_arch) + " (PTX compiled by the driver for sm_" +
                                  arch(caps.compute_capability) + ")"
                            : "sm_" + arch(caps.code_arch);
#else
  TORCH_CHECK(false, "hierpar::cuda_code_arch: this build of hierpar_ops has no CUDA kernels (device ", device, ")");
#endif
}

}  // namespace hierpar::ops

TORCH_LIBRARY_FRAGMENT(hierpar, m) {
  m.def("cuda_arch_list() -> str", &hierpar::ops::cuda_arch_list);
  m.def("cuda_code_arch(int device) -> str", &hierpar::ops::cuda_code_arch);
}
