// hierpar::nn::BatchNorm2d and BatchNormAct2d: torch::nn::BatchNorm2d's options, parameters (weight, bias)
// and buffers (running_mean, running_var, num_batches_tracked) on hierpar::batch_norm_act, the latter with
// the following activation fused in.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

namespace hierpar::nn {

enum class Activation { identity, relu, leaky_relu };
const char* to_string(Activation activation);

class BatchNormAct2dImpl : public torch::nn::Cloneable<BatchNormAct2dImpl> {
 public:
  explicit BatchNormAct2dImpl(const torch::nn::BatchNorm2dOptions& options,
                              Activation activation = Activation::relu, double negative_slope = 0.01);
  explicit BatchNormAct2dImpl(int64_t num_features, Activation activation = Activation::relu,
                              double negative_slope = 0.01)
      : BatchNormAct2dImpl(torch::nn::BatchNorm2dOptions(num_features), activation, negative_slope) {}

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  torch::Tensor forward(const torch::Tensor& input);

  torch::nn::BatchNorm2dOptions options;
  Activation activation;
  double negative_slope;
  torch::Tensor weight, bias;                                   // affine parameters (undefined if !affine)
  torch::Tensor running_mean, running_var, num_batches_tracked; // buffers (undefined if !track_running_stats)
};
TORCH_MODULE(BatchNormAct2d);

// BatchNorm2d with no activation: exactly torch::nn::BatchNorm2d, on hierpar's kernels.
class BatchNorm2dImpl : public BatchNormAct2dImpl {
 public:
  explicit BatchNorm2dImpl(const torch::nn::BatchNorm2dOptions& options)
      : BatchNormAct2dImpl(options, Activation::identity) {}
  explicit BatchNorm2dImpl(int64_t num_features) : BatchNorm2dImpl(torch::nn::BatchNorm2dOptions(num_features)) {}
};
TORCH_MODULE(BatchNorm2d);

}  // namespace hierpar::nn
