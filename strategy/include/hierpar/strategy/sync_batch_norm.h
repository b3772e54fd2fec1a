// Synchronized BatchNorm across the replicas of a placement (AdversarialOptions::sync_batch_norm, off by
// default as in seed 000): the BatchNorm layers of hierpar's models normalise with the statistics of the
// whole global batch instead of their replica's share, as torch.nn.SyncBatchNorm does. The trainer
// installs one of these on a replica's thread (hierpar::nn::BatchNormSyncGuard) around each forward.
//
// Forward: each replica computes per channel its count n, mean m and sum of squared deviations M2 (a
// two-pass var_mean), and ONE all-reduce sums [n m, M2, n m^2, n]; the global mean is sum(n m) / N and
// the global variance (sum M2 + sum n m^2 - N mean^2) / N, so only the between-replica term can cancel.
// Running statistics take the unbiased global variance, identically on every replica.
// Backward: ONE all-reduce of [sum dy, sum dy (x - mean)] gives the terms of grad_input that couple the
// replicas; grad_weight and grad_bias stay local (the gradient averaging divides their sum by R), which
// with each replica's loss being the mean over its share gives single-device gradients on the whole batch.
#pragma once

#include "hierpar/nn/batch_norm.h"
#include "hierpar/strategy/averaging.h"

namespace hierpar::strategy {

class ReplicaBatchNormSync final : public hierpar::nn::BatchNormSync {
 public:
  // Statistics are summed by `averager.sum(local, network, ...)`, so over the replicas of `network`'s group.
  ReplicaBatchNormSync(GradientAverager& averager, int64_t local, Network network)
      : averager_(averager), local_(local), network_(network) {}

  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                        const torch::Tensor& running_mean, const torch::Tensor& running_var, double momentum,
                        double eps) override;

  // Sums `tensor` over the replicas (in place).
  void sum(const torch::Tensor& tensor) { averager_.sum(local_, network_, tensor); }

 private:
  GradientAverager& averager_;
  int64_t local_;
  Network network_;
};

}  // namespace hierpar::strategy
