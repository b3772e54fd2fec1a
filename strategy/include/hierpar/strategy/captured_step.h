// Pieces for running a whole training step as CUDA graphs, shared by AdversarialTrainer and the
// benchmarks (bench/bench_dcgan_step.cpp):
//  - AutocastScope: torch.autocast as a C++ scope;
//  - CapturedStep: one step of work on one device captured as a sequence of CUDA graphs ("segments")
//    that share one private memory pool and are replayed in capture order, with host work in between
//    (e.g. gradient averaging that cannot be captured, copies to another device) -- the recipe of
//    torch.cuda.graph: warm-up steps on a side stream, capture on that stream, replay on the current stream.
//    A step that moves between devices has one CapturedStep per device and captures it piece by piece
//    (open_segment / close_segment), in the order the step runs.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

namespace hierpar::strategy {

// torch.autocast(device_type, dtype) as a scope: enables autocast for `device_type` with `dtype` and, on
// leaving the outermost scope, drops the cached low-precision copies of the weights (they go stale once
// the optimiser steps). A disengaged dtype (std::nullopt) makes the scope do nothing.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType device_type_;
  bool enabled_, was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::kBFloat16;
};

// Whether this build and machine can capture CUDA graphs (a CUDA build with a visible GPU).
bool cuda_graphs_available();

// Gives the caching allocator's unused blocks back to the driver, on every device, before a capture, where a device's
// free memory is less than twice what its cache holds unused: the capture allocates from its own pool, which cannot
// reuse what eager steps cached, and inside a capture the allocator cannot free them (freeing synchronises). Call it
// where no capture is under way in this process.
void release_cached_memory_before_capture();

class CapturedStep {
 public:
  // Work of `device` (a CUDA device); `side_stream` (a stream of that device) is where warm-up and
  // capture run, default a stream from the pool. Throws on a build without CUDA.
  explicit CapturedStep(c10::Device device, std::optional<c10::Stream> side_stream = std::nullopt);
  ~CapturedStep();
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  // Runs `body` eagerly on the side stream, ordered after the current stream's work and before its
  // later work (what a capture needs first: lazy initialisations, cuDNN's algorithm search, autograd's
  // streams of the parameters' gradient accumulators).
  void warm_up(const std::function<void()>& body);

  // Captures `body` on the side stream without running it; every call of split() inside `body` ends a
  // segment and begins the next. Capture mode is thread-local, so that other threads (other replicas,
  // a data loader) may keep calling CUDA while this one captures. Replaces an earlier capture.
  void capture(const std::function<void()>& body);
  void split();

  // The same piece by piece: begin_capture() drops earlier segments; open_segment() starts capturing the next
  // segment on the side stream, which stays the device's current stream until close_segment(); end_capture()
  // after the last. Only one segment of a CapturedStep is open at a time. abandon_capture() ends an open segment
  // after a failure (the error that stopped it is the one to report) and drops every segment.
  void begin_capture();
  void open_segment();
  void close_segment();
  void end_capture();
  bool segment_open() const;
  void abandon_capture();

  bool captured() const;
  int64_t segments() const;
  // Replays segment `i` on the current stream; segments must be replayed in order 0, 1, ... each step.
  void replay(int64_t segment);
  // Kernel nodes over all segments (cudaGraphGetNodes).
  int64_t kernel_nodes() const;

  c10::Device device() const { return device_; }

 private:
  struct Impl;
  c10::Device device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hierpar::strategy
