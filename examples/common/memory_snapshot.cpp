#include "common/memory_snapshot.h"

#include "common/cli.h"

#ifdef HIERPAR_WITH_CUDA
#include <ATen/Context.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

namespace hierpar::examples {
namespace fs = std::filesystem;

MemorySnapshot::MemorySnapshot(std::string path, bool cuda) : path_(std::move(path)) {
  if (path_.empty()) return;
  if (!cuda) throw FlagError("--memory-snapshot: records the CUDA caching allocator; this run has no CUDA device");
#ifdef HIERPAR_WITH_CUDA
  const fs::path folder = fs::path(path_).parent_path();
  require_writable_folder("--memory-snapshot", folder.empty() ? "." : folder.string());
  // Every allocation and free with its C++ stack, from this point on. The stacks are named when the file is written,
  // from the libraries' symbol tables (dladdr) unless TORCH_SYMBOLIZE_MODE says otherwise: addr2line over libtorch's
  // debug information can take minutes, and a GPU host may not have it.
  setenv("TORCH_SYMBOLIZE_MODE", "dladdr", /*overwrite=*/0);
  // The allocator's per-device state exists once CUDA has started: recording set before would reach no device.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  // stacks "all": torch's recorder takes "python" or "all"; in a program without Python, "all" gathers the C++ frames.
  torch::cuda::_record_memory_history(std::optional<std::string>("all"), std::optional<std::string>("all"), "all");
  recording_ = true;
#else
  throw FlagError("--memory-snapshot: this build of hierpar has no CUDA");
#endif
}

MemorySnapshot::~MemorySnapshot() {
#ifdef HIERPAR_WITH_CUDA
  if (recording_) torch::cuda::_record_memory_history(std::nullopt);
#endif
}

std::string MemorySnapshot::after_step(int64_t steps_done) {
  return recording_ && steps_done >= kSteps ? write(steps_done) : std::string();
}

std::string MemorySnapshot::finish() { return recording_ ? write(-1) : std::string(); }

std::string MemorySnapshot::write(int64_t steps) {
#ifdef HIERPAR_WITH_CUDA
  const std::string pickled = torch::cuda::_memory_snapshot_pickled();
  torch::cuda::_record_memory_history(std::nullopt);
  recording_ = false;
  // A temporary file beside it, renamed over it: a reader never sees half a snapshot.
  const std::string temporary = path_ + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(pickled.data(), static_cast<std::streamsize>(pickled.size()));
    if (!out.flush()) throw Error("--memory-snapshot: could not write " + temporary);
  }
  fs::rename(temporary, path_);
  return "memory snapshot of " + (steps < 0 ? std::string("the run's steps") : "steps 1-" + std::to_string(steps)) +
         ": " + path_ + " (" + std::to_string(pickled.size() >> 10) + " KiB; open it at https://pytorch.org/memory_viz)";
#else
  (void)steps;
  return {};
#endif
}

}  // namespace hierpar::examples
