// What a GPU, and the code this build loaded for it, let hierpar's kernels use (private to hierpar_ops).
//
// Every kernel family's predicate asks this instead of assuming Hopper: the tensor-core kernels need code built
// for sm_80 or newer (mma.sync, cp.async, ldmatrix, TF32), the cluster kernels sm_90, the wide GEMM tiles a
// shared-memory opt-in of 108 KB per block (A100, H100; not the 99 KB of sm_86/89/120). "Code built for" is the
// virtual architecture the driver loaded hierpar's kernels from, which can be older than the GPU: a build that
// holds only compute_80 PTX runs its Ampere paths on an H100 (docs/architectures.md).
//
// Read once per device, on the first CUDA op there; the routing then costs a load, not a property query.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace hierpar::detail {

struct DeviceCaps {
  int index = -1;
  std::string name;
  int compute_capability = 0;  // major * 10 + minor: 80 A100, 86 RTX 3090, 89 L40S / RTX 4090, 90 H100, 100 B200
  // The virtual architecture (PTX target, major * 10 + minor) of the code the driver loaded for this GPU, and
  // whether the driver compiled that code from PTX at load (no machine code in the build for this GPU).
  int code_arch = 0;
  bool code_from_ptx = false;
  int multiprocessors = 0;
  int max_smem_per_block = 0;  // bytes a block may opt into (cudaFuncAttributeMaxDynamicSharedMemorySize)
  int smem_per_multiprocessor = 0;

  bool ampere_instructions() const { return code_arch >= 80; }  // cp.async, mma.sync for bf16 / fp16 / TF32
  bool clusters() const { return code_arch >= 90; }             // thread-block clusters, distributed shared memory
};

// The capabilities of CUDA device `device`, read on first use. Throws one line naming the GPU's compute capability
// and the architectures this build holds when the build has no code the GPU can run (instead of CUDA's "no kernel
// image is available" at the first launch).
const DeviceCaps& device_caps(int64_t device);

// The same for the current device (the callers set it with a CUDAGuard first).
const DeviceCaps& current_device_caps();

// Every CUDA op calls this first: on a GPU this build has no code for, the op fails with device_caps' line before
// any launch.
inline void check_device_code(c10::DeviceIndex device) { (void)device_caps(device); }

}  // namespace hierpar::detail
