// Two independent parts of one op run concurrently on two streams of one device (private to hierpar_ops).
//
// Why: at batch 64 the backward of a DCGAN layer is two kernels of a few microseconds and tens of CTAs each
// (grad_input and grad_weight) on a 132-SM GPU; on one stream the second waits for the first's tail. On two
// streams they share the GPU.
//
// How: `on_side` is enqueued on a pool stream that first waits for everything already on the current stream
// (fork event), `on_current` on the current stream, and the current stream waits for the side stream's work
// (join event) before this returns. To its caller the op therefore behaves as if it ran on the current stream
// alone:
//  - CUDA graphs: a fork/join by events is what stream capture records as a branch of the graph (the side
//    stream joins the capture through the fork event and leaves it through the join, which capture_end
//    requires); the caching allocator serves the side stream's allocations from the graph's pool like the
//    capturing stream's, since it matches streams by capture id.
//  - Caching allocator: tensors allocated on the current stream that `on_side` reads or writes (the op's
//    inputs and outputs) carry no record of the side stream's use (no record_stream), which is safe only
//    because the join comes before this function returns: anything the caller enqueues afterwards, a reuse of
//    those blocks included, is ordered after the side work. Tensors allocated inside `on_side` belong to the
//    side stream; freeing them there (while its kernels may still run) is safe because the allocator only
//    hands a block back out to the stream it belongs to, in stream order. `on_side` must not return a tensor
//    it allocated to the current stream (that would need record_stream); the callers write only into
//    outputs allocated beforehand.
//  - Both parts must be independent: neither may read what the other writes.
#pragma once

#include "common.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <vector>

namespace hierpar::detail {

// The fork and join events of the calling thread on one device, created on first use and reused by every
// call: cudaStreamWaitEvent waits for the record that precedes it (in capture as well), so recording the same
// event again later cannot change a wait already enqueued. Destroyed with the thread. Also the thread's two
// side streams on the device, taken once from the high-priority pool: a fresh pool stream per call would walk
// the low-priority pool round-robin and sooner or later hand out a stream that a caller keeps busy with work
// of its own (the trainer's two streams, a capture's stream), tying the side work to that work; of the two,
// the one that is not the current stream is used.
struct ForkJoinEvents {
  cudaEvent_t fork = nullptr, join = nullptr;
  std::vector<c10::cuda::CUDAStream> sides;
  ForkJoinEvents() = default;
  ForkJoinEvents(const ForkJoinEvents&) = delete;
  ForkJoinEvents& operator=(const ForkJoinEvents&) = delete;
  ~ForkJoinEvents() {
    // At process exit the CUDA runtime may already be gone; nothing to report then.
    if (fork) (void)cudaEventDestroy(fork);
    if (join) (void)cudaEventDestroy(join);
  }
};

// Requires `device` to be the current device (the caller's CUDAGuard).
inline ForkJoinEvents& fork_join_events(c10::DeviceIndex device) {
  thread_local std::vector<std::unique_ptr<ForkJoinEvents>> per_device;
  if (per_device.size() <= size_t(device)) per_device.resize(size_t(device) + 1);
  auto& events = per_device[device];
  if (!events) {
    auto made = std::make_unique<ForkJoinEvents>();
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&made->fork, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&made->join, cudaEventDisableTiming));
    for (int k = 0; k < 2; ++k) made->sides.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device));
    events = std::move(made);
  }
  return *events;
}

// Switch::side_stream off runs both parts on the current stream, one after the other (same-process A/B timings).
inline bool side_stream_enabled() { return switch_on(Switch::side_stream); }

// See the file comment. `on_side` is enqueued first, so that its kernels start while the host is still
// launching `on_current`'s.
template <typename OnCurrent, typename OnSide>
void run_side_by_side(c10::Device device, OnCurrent&& on_current, OnSide&& on_side) {
  if (!side_stream_enabled()) {
    on_current();
    on_side();
    return;
  }
  const c10::cuda::CUDAGuard device_guard(device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  const ForkJoinEvents& events = fork_join_events(device.index());
  const c10::cuda::CUDAStream side = events.sides[0] == current ? events.sides[1] : events.sides[0];
  C10_CUDA_CHECK(cudaEventRecord(events.fork, current.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), events.fork, 0));
  try {
    {
      const c10::cuda::CUDAStreamGuard on_side_stream(side);
      on_side();
    }
    on_current();
  } catch (...) {
    // Still join, so that no side work outlives the tensors the caller frees while unwinding.
    (void)cudaEventRecord(events.join, side.stream());
    (void)cudaStreamWaitEvent(current.stream(), events.join, 0);
    throw;
  }
  C10_CUDA_CHECK(cudaEventRecord(events.join, side.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), events.join, 0));
}

}  // namespace hierpar::detail
