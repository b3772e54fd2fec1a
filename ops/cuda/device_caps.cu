#include "cuda/device_caps.h"

#include "hierpar/ops.h"
#include "hierpar/switches.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

namespace hierpar::detail {
namespace {

// Compiled like every other kernel of hierpar_ops (CMake gives all CUDA files one architecture list; the k4s2p1
// file's extra sm_90a image has its own probe, wgmma_available), so the code the driver picks for it is the code
// it picks for them.
__global__ void code_arch_probe_kernel() {}

std::string arch_name(int arch) { return std::to_string(arch / 10) + "." + std::to_string(arch % 10); }

DeviceCaps read_caps(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceCaps caps;
  caps.index = device;
  caps.name = prop.name;
  caps.compute_capability = prop.major * 10 + prop.minor;
  caps.multiprocessors = prop.multiProcessorCount;
  caps.max_smem_per_block = static_cast<int>(prop.sharedMemPerBlockOptin);
  // HIERPAR_MAX_SMEM_PER_BLOCK=<bytes> makes the routing assume a smaller opt-in: with 101376 (the 99 KB of sm_86,
  // sm_89, sm_120) an H100 runs those GPUs' kernel choices (scripts/gpu-check --arch 8.6).
  if (const auto bytes = knob(Knob::max_smem_per_block)) {
    caps.max_smem_per_block = static_cast<int>(std::min<int64_t>(caps.max_smem_per_block, *bytes));
  }
  caps.smem_per_multiprocessor = static_cast<int>(prop.sharedMemPerMultiprocessor);

  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, code_arch_probe_kernel);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it, so the caller's next CUDA call does not report it
    const std::string built = hierpar::ops::cuda_arch_list();
    const std::string gpu = "GPU " + std::to_string(device) + " (" + caps.name + ", compute capability " +
                            arch_name(caps.compute_capability) + ")";
    TORCH_CHECK(err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction,
                "hierpar: this build of hierpar_ops has no code for ", gpu, ": it was built for CUDA architectures ",
                built.empty() ? "(none)" : built, ". Rebuild with TORCH_CUDA_ARCH_LIST unset (every architecture the ",
                "installed torch supports) or including ", arch_name(caps.compute_capability), ".");
    TORCH_CHECK(err != cudaErrorUnsupportedPtxVersion,
                "hierpar: the driver cannot compile this build's PTX for ", gpu, " (the PTX is newer than the driver; ",
                "built for ", built, "): update the driver or rebuild with this GPU's architecture in ",
                "TORCH_CUDA_ARCH_LIST.");
    C10_CUDA_CHECK(err);
  }
  caps.code_arch = attr.ptxVersion;
  caps.code_from_ptx = attr.binaryVersion != attr.ptxVersion;
  return caps;
}

struct CapsTable {
  std::vector<std::once_flag> once;
  std::vector<DeviceCaps> caps;
  explicit CapsTable(int n) : once(n), caps(n) {}
};

}  // namespace

const DeviceCaps& device_caps(int64_t device) {
  static CapsTable table(c10::cuda::device_count());
  TORCH_CHECK(device >= 0 && device < static_cast<int64_t>(table.caps.size()), "hierpar: CUDA device ", device,
              " does not exist (", table.caps.size(), " visible)");
  // A failed read (no code for this GPU) leaves the flag unset: every later call says the same again.
  std::call_once(table.once[device], [&] { table.caps[device] = read_caps(static_cast<c10::DeviceIndex>(device)); });
  return table.caps[device];
}

const DeviceCaps& current_device_caps() { return device_caps(c10::cuda::current_device()); }

}  // namespace hierpar::detail
