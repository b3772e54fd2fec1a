// Whether the driver loaded the sm_90a code of the k4s2p1 wgmma kernels (k4s2p1.cuh), asked by every wgmma
// predicate. This file is built for the same architectures as the wgmma files (sm_90a included, CMakeLists.txt),
// so the cubin the driver picks for it is the one it picks for them.
#include "cuda/k4s2p1/k4s2p1.cuh"

#include <atomic>

namespace hierpar::detail::k4s2p1 {
namespace {

// Whether the code loaded for this process's kernels is the sm_90a one (this file and the wgmma ones are compiled
// for sm_90 and sm_90a; which cubin the driver picks is its choice), so that the wgmma kernels have their bodies.
__global__ void sm90a_probe_kernel(int* flag) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *flag = 1;
#else
  *flag = 0;
#endif
}

}  // namespace

// Probed once per process (synchronously: not while the stream is being captured into a CUDA graph, where
// the mma.sync kernel is used until a probe has run outside a capture).
bool wgmma_available() {
  // Switch::wgmma off keeps the mma.sync kernels (same-process before / after timings, bisecting).
  if (!switch_on(Switch::wgmma)) return false;
  static std::atomic<int> state{-1};
  const int known = state.load();
  if (known >= 0) return known == 1;
  if (current_device_caps().compute_capability != 90) {
    state = 0;
    return false;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  at::Tensor flag = at::empty({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA));
  sm90a_probe_kernel<<<1, 1, 0, stream>>>(flag.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool ok = flag.item<int>() == 1;
  state = ok ? 1 : 0;
  return ok;
}

}  // namespace hierpar::detail::k4s2p1
