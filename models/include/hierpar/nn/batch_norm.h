// hierpar::nn::BatchNorm2d and BatchNormAct2d: torch::nn::BatchNorm2d's options, parameters (weight, bias)
// and buffers (running_mean, running_var, num_batches_tracked) on hierpar::batch_norm_act, the latter with
// the following activation fused in. State dicts interchange with torch::nn::BatchNorm2d.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <ostream>

namespace hierpar::nn {

enum class Activation { identity, relu, leaky_relu };
const char* to_string(Activation activation);

// Synchronized BatchNorm (hierpar::strategy's AdversarialOptions::sync_batch_norm): while a thread has a
// BatchNormSync installed (BatchNormSyncGuard), the training-mode forward of BatchNorm2d/BatchNormAct2d
// below, and of the stock torch::nn::BatchNorm2d built by models::make_batch_norm_act2d, normalises on
// that thread through it, with statistics over every replica. None is installed by default: the
// default path costs one thread-local read.
class BatchNormSync {
 public:
  virtual ~BatchNormSync() = default;
  // Batch normalisation in training mode (no activation) of `input` [N, C, H, W] with the statistics of
  // the whole global batch; `running_mean`/`running_var` (undefined when not tracked) are updated with
  // `momentum` (already resolved: cumulative averages pass 1 / batches tracked); `weight`/`bias` may be
  // undefined (affine false).
  virtual torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                                const torch::Tensor& running_mean, const torch::Tensor& running_var, double momentum,
                                double eps) = 0;
};
BatchNormSync* batch_norm_sync();  // this thread's, or nullptr
class BatchNormSyncGuard {
 public:
  explicit BatchNormSyncGuard(BatchNormSync* sync);
  ~BatchNormSyncGuard();
  BatchNormSyncGuard(const BatchNormSyncGuard&) = delete;
  BatchNormSyncGuard& operator=(const BatchNormSyncGuard&) = delete;

 private:
  BatchNormSync* previous_;
};

// A batch norm's tensors by torch::nn::BatchNorm2d's names, for the layers' constructors around existing tensors
// below; undefined where the options keep none (weight and bias without affine, the rest without
// track_running_stats).
struct BatchNormTensors {
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
};

namespace detail {
// The shared implementation; `Derived` is the concrete Impl so that clone() returns the right type.
template <typename Derived>
class BatchNormActImplBase : public torch::nn::Cloneable<Derived> {
 public:
  BatchNormActImplBase(const torch::nn::BatchNorm2dOptions& options, Activation activation, double negative_slope);
  // Around existing tensors instead of new ones (hierpar::nn::converted builds on it, from a torch::nn::BatchNorm2d's):
  // registered as they are, neither copied nor initialised, requires_grad kept, so that every holder of them (an
  // optimizer, another module) sees this layer's updates and this layer theirs. clone() still gives a copy with
  // tensors of its own.
  BatchNormActImplBase(const torch::nn::BatchNorm2dOptions& options, Activation activation, double negative_slope,
                       const BatchNormTensors& tensors);

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  // Input [N, C, H, W] (any layout; the output keeps it). Training, or no running statistics: batch
  // statistics (running ones updated when tracked; momentum None = cumulative average); eval: running ones.
  torch::Tensor forward(const torch::Tensor& input);

  torch::nn::BatchNorm2dOptions options;
  Activation activation;
  double negative_slope;
  torch::Tensor weight, bias;                                    // affine parameters (undefined if !affine)
  torch::Tensor running_mean, running_var, num_batches_tracked;  // buffers (undefined if !track_running_stats)

 protected:
  virtual const char* name() const = 0;
};
}  // namespace detail

class BatchNormAct2dImpl : public detail::BatchNormActImplBase<BatchNormAct2dImpl> {
 public:
  explicit BatchNormAct2dImpl(const torch::nn::BatchNorm2dOptions& options, Activation activation = Activation::relu,
                              double negative_slope = 0.01)
      : BatchNormActImplBase(options, activation, negative_slope) {}
  explicit BatchNormAct2dImpl(int64_t num_features, Activation activation = Activation::relu,
                              double negative_slope = 0.01)
      : BatchNormAct2dImpl(torch::nn::BatchNorm2dOptions(num_features), activation, negative_slope) {}
  // Around existing tensors (see BatchNormActImplBase).
  BatchNormAct2dImpl(const torch::nn::BatchNorm2dOptions& options, Activation activation, double negative_slope,
                     const BatchNormTensors& tensors)
      : BatchNormActImplBase(options, activation, negative_slope, tensors) {}

 protected:
  const char* name() const override { return "hierpar::nn::BatchNormAct2d"; }
};
TORCH_MODULE(BatchNormAct2d);

// BatchNorm2d with no activation: torch::nn::BatchNorm2d, on hierpar's kernels.
class BatchNorm2dImpl : public detail::BatchNormActImplBase<BatchNorm2dImpl> {
 public:
  explicit BatchNorm2dImpl(const torch::nn::BatchNorm2dOptions& options)
      : BatchNormActImplBase(options, Activation::identity, 0.01) {}
  explicit BatchNorm2dImpl(int64_t num_features) : BatchNorm2dImpl(torch::nn::BatchNorm2dOptions(num_features)) {}
  // Around existing tensors (see BatchNormActImplBase).
  BatchNorm2dImpl(const torch::nn::BatchNorm2dOptions& options, const BatchNormTensors& tensors)
      : BatchNormActImplBase(options, Activation::identity, 0.01, tensors) {}

 protected:
  const char* name() const override { return "hierpar::nn::BatchNorm2d"; }
};
TORCH_MODULE(BatchNorm2d);

namespace detail {
extern template class BatchNormActImplBase<BatchNormAct2dImpl>;
extern template class BatchNormActImplBase<BatchNorm2dImpl>;
}  // namespace detail

}  // namespace hierpar::nn
