// hierpar-dcgan train --memory-snapshot FILE: the CUDA caching allocator's history over a run's first steps (every
// allocation and free, with its C++ stack, and the segments held at the end), written as the pickle that
// https://pytorch.org/memory_viz draws. It shows what a step holds at its peak and which layer asked for it.
#pragma once

#include <cstdint>
#include <string>

namespace hierpar::examples {

class MemorySnapshot {
 public:
  // The steps recorded: the eager warm-up, a CUDA graph's capture and replay, and --memory offload's measured and
  // planned steps all fall in a run's first five.
  static constexpr int64_t kSteps = 5;

  // Starts recording when `path` is not empty. Throws FlagError when the run has no CUDA device or `path`'s folder
  // cannot be written.
  MemorySnapshot(std::string path, bool cuda);
  ~MemorySnapshot();  // stops recording (the file is written by after_step or finish)
  MemorySnapshot(const MemorySnapshot&) = delete;
  MemorySnapshot& operator=(const MemorySnapshot&) = delete;

  // After the run's `steps_done`-th step: writes the file once kSteps have run; returns what to tell the user then
  // (empty otherwise).
  std::string after_step(int64_t steps_done);
  // At the end of a run shorter than kSteps: writes what was recorded. Empty when written already or not recording.
  std::string finish();

 private:
  std::string write(int64_t steps);
  std::string path_;
  bool recording_ = false;
};

}  // namespace hierpar::examples
