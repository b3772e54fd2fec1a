// Gradient averaging across the replicas of a placement, behind one interface with two implementations:
//  - host: each replica flattens a network's gradients into one pinned host buffer; the replicas' own
//    threads (one per replica, like seed 000's OpenMP threads) each sum one slice over all replicas;
//    the sum goes back to every replica's device (across processes the host sums meet through Gloo);
//  - collective: each replica flattens a network's gradients into ONE device buffer that a c10d process
//    group all-reduces (ProcessGroupNCCL for CUDA, ProcessGroupGloo for CPU).
// Both divide the sum by the global replica count on the device, so they agree bit for bit for two replicas.
// Replicas in one process are threads that are ranks of the same groups (a shared HashStore); replicas in
// other processes join through a TCPStore at MASTER_ADDR:MASTER_PORT. The code path is the same.
#pragma once

#include "hierpar/strategy/placement.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <vector>

namespace hierpar::strategy {

enum class Network { generator = 0, discriminator = 1 };
const char* to_string(Network network);

class GradientAverager {
 public:
  virtual ~GradientAverager() = default;

  // Called concurrently by every local replica's thread (`local` in [0, local replicas)); returns when
  // `grads` (that replica's gradients of `network`, on its device for that network) hold the average over
  // all replicas everywhere. Device work is stream-ordered; the host waits only where the scheme must
  // (host averaging reads the gradients on the CPU). Throws a c10::Error naming the replica and the
  // network when a peer replica failed or a collective timed out.
  virtual void average(int64_t local, Network network, const std::vector<at::Tensor>& grads) = 0;

  // Called concurrently by every local replica's thread: every replica's `tensors` take global replica
  // 0's values (initial parameters, a resumed checkpoint).
  virtual void broadcast_from_first(int64_t local, Network network, const std::vector<at::Tensor>& tensors) = 0;

  // Called once by a failing replica's thread so that the others stop waiting for it (in-process waits
  // end at once; collectives with other processes end by their timeout).
  virtual void abort(const std::string& reason) = 0;

  // Called by every local replica's thread before its first average(): collectives may rendezvous here.
  virtual void connect(int64_t local) = 0;
};

struct AveragingOptions {
  // Bound on every wait for a peer replica (in-process barriers and c10d collectives): a replica that
  // dies or throws makes the others fail with an error after at most this long, never hang.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// The averager for `placement.reduce`; nullptr when there is one replica in all (nothing to average).
std::unique_ptr<GradientAverager> make_averager(const Placement& placement, const AveragingOptions& options = {});

// Whether this build can create the Gloo process group (CPU collectives): LibTorch's wheels lack the gloo
// headers, so the build takes them from the system (Debian's libgloo-dev).
bool gloo_available();

}  // namespace hierpar::strategy
