#include "host_flag.h"

#include <c10/util/Exception.h>

#ifdef HIERPAR_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#endif


namespace hierpar::strategy {

#ifdef HIERPAR_WITH_CUDA
namespace {

// cuStreamWaitValue32 from the driver the runtime loaded (no link against libcuda), or null.
PFN_cuStreamWaitValue32_v11070 wait_value_entry() {
  static const auto entry = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn);
  }();
  return entry;
}

}  // namespace

// 32-bit waits are part of the v2 memory-operation API every CUDA 12+ driver offers on every device.
bool HostFlag::available(const c10::Device& device) { return device.is_cuda() && wait_value_entry() != nullptr; }

HostFlag::HostFlag() {
  void* p = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable));
  value_ = static_cast<uint32_t*>(p);
  *value_ = 0;
  void* on_device = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&on_device, p, 0));
  device_address_ = reinterpret_cast<uintptr_t>(on_device);
}

HostFlag::~HostFlag() {
  if (value_ != nullptr) (void)cudaFreeHost(value_);
}

void HostFlag::enqueue_wait(const c10::Stream& stream, uint32_t value) const {
  const c10::cuda::CUDAStream cuda_stream(c10::cuda::CUDAStream::UNCHECKED, stream);
  const CUresult result = wait_value_entry()(cuda_stream.stream(), static_cast<CUdeviceptr>(device_address_), value,
                                             CU_STREAM_WAIT_VALUE_GEQ);
  TORCH_CHECK(result == CUDA_SUCCESS, "HostFlag: cuStreamWaitValue32 failed with CUresult ", int(result));
}

void HostFlag::set(uint32_t value) { __atomic_store_n(value_, value, __ATOMIC_RELEASE); }

#else  // no CUDA: nothing waits on the host

bool HostFlag::available(const c10::Device&) { return false; }
HostFlag::HostFlag() = default;
HostFlag::~HostFlag() = default;
void HostFlag::enqueue_wait(const c10::Stream&, uint32_t) const {
  TORCH_CHECK(false, "HostFlag: this build of hierpar has no CUDA");
}
void HostFlag::set(uint32_t) {}

#endif

}  // namespace hierpar::strategy
