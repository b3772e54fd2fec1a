#include "part_link.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace hierpar::strategy::detail {

PartLink::PartLink(const Placement& placement, const c10::intrusive_ptr<c10d::Store>& store,
                   std::chrono::milliseconds timeout)
    : who_(c10::str("replica ", placement.replicas.at(0).replica, "'s ", to_string(placement.replicas.at(0).part),
                    " (rank ", placement.launch.rank, ", its ",
                    placement.replicas.at(0).part == ReplicaPart::generator ? "discriminator" : "generator", " on rank ",
                    placement.peer_rank(), ")")),
      rank_(placement.replicas.at(0).part == ReplicaPart::generator ? 0 : 1),
      timeout_(timeout) {
  TORCH_CHECK(placement.split(), "PartLink: only the processes of a split placement exchange fakes");
  const c10::Device device = placement.replicas[0].generator;
#ifdef HIERPAR_C10D_NCCL
  if (device.is_cuda()) initialise_nccl_once();
#endif
  group_ = make_backend(c10::make_intrusive<c10d::PrefixStore>(c10::str("pair-", placement.replicas[0].replica), store),
                        rank_, 2, device.type(), placement.launch, timeout);
#ifdef HIERPAR_C10D_NCCL
  if (device.is_cuda()) group_->eagerConnectSingleDevice(device);
#endif
  // A first transfer, awaited: both processes are connected before the first step, whose time it would otherwise add.
  at::Tensor probe = at::zeros({1}, at::TensorOptions().device(device));
  transfer(probe, 0, "the link's first transfer");
  (void)probe.item<float>();
}

PartLink::~PartLink() { release_backend(group_); }

void PartLink::send(const at::Tensor& tensor, const char* what) { transfer(tensor, rank_, what); }

void PartLink::receive(const at::Tensor& into, const char* what) { transfer(into, 1 - rank_, what); }

void PartLink::transfer(const at::Tensor& tensor, int64_t root, const char* what) {
  entered_.fetch_add(1, std::memory_order_relaxed);
  TORCH_CHECK(tensor.is_non_overlapping_and_dense(), who_, ": ", what, " must be dense to travel between the processes");
  std::vector<at::Tensor> buffers{tensor};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout_;
  wait_for(group_->broadcast(buffers, options), who_, what, timeout_, aborted_, tensor.is_cuda());
}

void PartLink::abort(const std::string& reason) {
  if (!aborted_.set(reason)) return;
  if (group_ && group_->getBackendName() == "nccl") abort_nccl_groups({group_});
}

}  // namespace hierpar::strategy::detail
