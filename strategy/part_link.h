// The two processes of a split replica (ReplicaPart: G in rank 2r, D in rank 2r + 1) exchange what crosses between
// G's and D's parts of a step: the fakes (G to D), their gradient and the logged losses (D to G). A two-rank process
// group (NCCL on CUDA, Gloo on CPU) carries each as a broadcast from the rank that has it: on CUDA the host does not
// wait (the current stream is ordered after the transfer), on the CPU it waits at most the timeout. Internal to
// strategy/.
#pragma once

#include "averaging_parts.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

namespace hierpar::strategy::detail {

class PartLink {
 public:
  // `store`: where both processes meet (every pair under its own prefix of it). Connects at once: the peer must
  // construct its link too.
  PartLink(const Placement& placement, const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout);
  ~PartLink();
  PartLink(const PartLink&) = delete;
  PartLink& operator=(const PartLink&) = delete;

  // This part's `tensor` to the peer (`what` names it in errors), or the peer's into `into` (same shape, dtype and
  // memory format; dense). Throws a PeerFailure when the peer failed, died, did not come within the timeout or the
  // link was aborted.
  void send(const at::Tensor& tensor, const char* what);
  void receive(const at::Tensor& into, const char* what);

  // From any thread: waits on the link end with a PeerFailure naming `reason`; an NCCL communicator is aborted.
  void abort(const std::string& reason);
  // Transfers entered so far (a hung process's count stops below its peer's: RunGuard).
  int64_t progress() const { return entered_.load(std::memory_order_relaxed); }

 private:
  void transfer(const at::Tensor& tensor, int64_t root, const char* what);

  const std::string who_;
  const int64_t rank_;  // in the pair: 0 runs G, 1 runs D
  const std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Backend> group_;
  AbortState aborted_;
  std::atomic<int64_t> entered_{0};
};

}  // namespace hierpar::strategy::detail
