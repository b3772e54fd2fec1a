#include "hierpar/strategy/captured_step.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#ifdef HIERPAR_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <optional>
#include <vector>

namespace hierpar::strategy {

AutocastScope::AutocastScope(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype)
    : device_type_(device_type), enabled_(dtype.has_value()) {
  if (!enabled_) return;
  was_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  was_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, *dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, was_enabled_);
  at::autocast::set_autocast_dtype(device_type_, was_dtype_);
}

#ifdef HIERPAR_WITH_CUDA

bool cuda_graphs_available() { return c10::cuda::device_count() > 0; }

void release_cached_memory_before_capture() {
  // Only where a device may not otherwise hold the capture's pool (a capture keeps a block freed on another stream
  // until it ends, so it can need more than the step freed into the cache). Releasing costs device synchronisations
  // and fresh allocations: 0.03-0.05 s of a 0.2 s trial in hierpar-dcgan tune at 64x64, where nothing needs it. At the
  // memory bound it leaves a little: the largest captured batch at 128x128 width 2 on an H100 is 3456 with this rule,
  // 3712 when the cache is always released (docs/batch_size.md).
  bool short_of_memory = false;
  for (c10::DeviceIndex d = 0; d < c10::cuda::device_count() && !short_of_memory; ++d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d);
    const int64_t cached = stats.reserved_bytes[0].current - stats.allocated_bytes[0].current;
    if (cached <= 0) continue;  // also a device this process never used: no context is made for it
    const c10::cuda::CUDAGuard guard(d);
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    short_of_memory = static_cast<int64_t>(free) < 2 * cached;
  }
  if (short_of_memory) c10::cuda::CUDACachingAllocator::emptyCache();
}

struct CapturedStep::Impl {
  explicit Impl(c10::cuda::CUDAStream side) : side(side) {}
  c10::cuda::CUDAStream side;
  at::cuda::MempoolId_t pool{0, 0};
  std::vector<std::unique_ptr<at::cuda::CUDAGraph>> graphs;
  bool capturing = false;  // between begin_capture() and the end of capture() / the last close_segment()
  // While a segment captured piece by piece is open: the side stream made current on the device.
  std::optional<c10::cuda::CUDAStreamGuard> open_guard;
  // Recorded on the side stream after each segment's capture. CUDAGraph::capture_begin() resets the generator's
  // graph offset with eager fills on the side stream, outside the graph; a replay sets that offset on its own
  // stream, so it must come after them, or a lagging side stream's reset lands between the replay's setting and
  // the graph's random draws (which then repeat the seed's first numbers).
  at::cuda::CUDAEvent captured_on_side;

  void begin_segment() {
    graphs.push_back(std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true));
    graphs.back()->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
  }
  void end_segment() {
    graphs.back()->capture_end();
    graphs.back()->instantiate();
    captured_on_side.record(side);
  }
  // Ends a capture that failed, so that the stream is usable again, and drops its segments. The capture must end
  // with its stream current, on its device.
  void abandon(c10::Device device) {
    c10::cuda::CUDAGuard device_guard(device);
    if (capturing && !graphs.empty()) {
      try {
        graphs.back()->capture_end();
      } catch (...) {
        // CUDA ended the capture as invalid (e.g. the allocator freed memory inside it while running out): undo
        // what CUDAGraph::capture_end() would have, or the next eager step fails.
        undo_failed_capture(device);
      }
    }
    capturing = false;
    open_guard.reset();
    graphs.clear();
  }

  // The allocator stops routing the stream's allocations to the graph's pool and drops the failed graph's use of
  // it; the device's default generator (which capture_begin() put in capture mode) gets a state outside capture,
  // at the same seed and offset.
  void undo_failed_capture(c10::Device device) {
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device.index(), pool);
    } catch (const c10::Error&) {  // capture_end() got past its own endAllocateToPool()
    }
    c10::cuda::CUDACachingAllocator::releasePool(device.index(), pool);  // ~CUDAGraph() does not, without a graph
    at::Generator generator = at::cuda::detail::getDefaultCUDAGenerator(device.index());
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Generator outside_capture = at::make_generator<at::CUDAGeneratorImpl>(device.index());
    outside_capture.set_state(generator.get_state());
    generator.graphsafe_set_state(outside_capture);
  }
};

namespace {
c10::cuda::CUDAStream side_stream_for(c10::Device device, const std::optional<c10::Stream>& stream) {
  TORCH_CHECK(device.is_cuda() && device.has_index(), "CapturedStep: device: expected an indexed CUDA device, got ",
              device);
  if (!stream) return c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  TORCH_CHECK(stream->device() == device, "CapturedStep: side_stream: expected a stream of ", device, ", got one of ",
              stream->device());
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, *stream);
}

// `waiter` waits for the work queued so far on `producer`.
void order(const c10::cuda::CUDAStream& producer, const c10::cuda::CUDAStream& waiter) {
  at::cuda::CUDAEvent event;
  event.record(producer);
  event.block(waiter);
}
}  // namespace

CapturedStep::CapturedStep(c10::Device device, std::optional<c10::Stream> side_stream)
    : device_(device), impl_(std::make_unique<Impl>(side_stream_for(device, side_stream))) {}

CapturedStep::~CapturedStep() = default;

void CapturedStep::warm_up(const std::function<void()>& body) {
  c10::cuda::CUDAGuard device_guard(device_);
  const auto current = c10::cuda::getCurrentCUDAStream(device_.index());
  order(current, impl_->side);
  {
    c10::cuda::CUDAStreamGuard stream_guard(impl_->side);
    body();
  }
  order(impl_->side, current);
}

void CapturedStep::capture(const std::function<void()>& body) {
  begin_capture();
  c10::cuda::CUDAGuard device_guard(device_);
  // The capture reads what the current stream wrote (parameters, static inputs) only when replayed, but
  // the side stream must not start capturing while earlier work on it is pending.
  order(c10::cuda::getCurrentCUDAStream(device_.index()), impl_->side);
  c10::cuda::CUDAStreamGuard stream_guard(impl_->side);
  try {
    impl_->begin_segment();
    body();
    impl_->end_segment();
  } catch (...) {
    impl_->abandon(device_);
    throw;
  }
  impl_->capturing = false;
}

void CapturedStep::split() {
  TORCH_CHECK(impl_->capturing && !impl_->open_guard, "CapturedStep: split() is only valid inside capture()");
  impl_->end_segment();
  impl_->begin_segment();
}

void CapturedStep::begin_capture() {
  TORCH_CHECK(!impl_->open_guard, "CapturedStep: begin_capture() while a segment is open");
  impl_->graphs.clear();
  impl_->pool = at::cuda::graph_pool_handle();
  impl_->capturing = true;
}

void CapturedStep::open_segment() {
  TORCH_CHECK(impl_->capturing && !impl_->open_guard, "CapturedStep: open_segment() needs begin_capture() and no "
              "open segment");
  c10::cuda::CUDAGuard device_guard(device_);
  order(c10::cuda::getCurrentCUDAStream(device_.index()), impl_->side);
  impl_->open_guard.emplace(impl_->side);
  try {
    impl_->begin_segment();
  } catch (...) {
    impl_->abandon(device_);
    throw;
  }
}

void CapturedStep::close_segment() {
  TORCH_CHECK(impl_->open_guard, "CapturedStep: close_segment() without an open segment");
  // The capture ends on the stream it began on: the side stream, current on this device (the caller may have made
  // another device current since open_segment()).
  c10::cuda::CUDAGuard device_guard(device_);
  try {
    impl_->end_segment();
  } catch (...) {
    impl_->abandon(device_);
    throw;
  }
  impl_->open_guard.reset();
}

void CapturedStep::end_capture() {
  TORCH_CHECK(impl_->capturing && !impl_->open_guard, "CapturedStep: end_capture() needs begin_capture() and no "
              "open segment");
  impl_->capturing = false;
}

bool CapturedStep::segment_open() const { return impl_->open_guard.has_value(); }

void CapturedStep::abandon_capture() { impl_->abandon(device_); }

bool CapturedStep::captured() const { return !impl_->graphs.empty() && !impl_->capturing; }

int64_t CapturedStep::segments() const { return static_cast<int64_t>(impl_->graphs.size()); }

void CapturedStep::replay(int64_t segment) {
  TORCH_CHECK(captured() && segment >= 0 && segment < segments(), "CapturedStep: replay: no captured segment ",
              segment, " (", segments(), " captured)");
  c10::cuda::CUDAGuard device_guard(device_);
  impl_->captured_on_side.block(c10::cuda::getCurrentCUDAStream(device_.index()));  // (a wait on a past event)
  impl_->graphs[segment]->replay();
}

int64_t CapturedStep::kernel_nodes() const {
  int64_t kernels = 0;
  for (const auto& graph : impl_->graphs) {
    cudaGraph_t raw = graph->raw_cuda_graph();
    size_t count = 0;
    C10_CUDA_CHECK(cudaGraphGetNodes(raw, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    C10_CUDA_CHECK(cudaGraphGetNodes(raw, nodes.data(), &count));
    for (auto node : nodes) {
      cudaGraphNodeType type;
      C10_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
      kernels += type == cudaGraphNodeTypeKernel;
    }
  }
  return kernels;
}

#else  // a LibTorch without CUDA: nothing can be captured

bool cuda_graphs_available() { return false; }
void release_cached_memory_before_capture() {}

struct CapturedStep::Impl {};

CapturedStep::CapturedStep(c10::Device device, std::optional<c10::Stream>) : device_(device) {
  TORCH_CHECK(false, "CapturedStep: this build of hierpar has no CUDA, so no CUDA graphs");
}
CapturedStep::~CapturedStep() = default;
void CapturedStep::warm_up(const std::function<void()>&) {}
void CapturedStep::capture(const std::function<void()>&) {}
void CapturedStep::split() {}
void CapturedStep::begin_capture() {}
void CapturedStep::open_segment() {}
void CapturedStep::close_segment() {}
void CapturedStep::end_capture() {}
bool CapturedStep::segment_open() const { return false; }
void CapturedStep::abandon_capture() {}
bool CapturedStep::captured() const { return false; }
int64_t CapturedStep::segments() const { return 0; }
void CapturedStep::replay(int64_t) {}
int64_t CapturedStep::kernel_nodes() const { return 0; }

#endif

}  // namespace hierpar::strategy
