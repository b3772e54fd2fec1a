// hierpar::nn::BatchNorm2d / BatchNormAct2d: torch::nn::BatchNorm2d's bookkeeping (parameters, buffers,
// momentum None = cumulative moving average, eval without running statistics = batch statistics) around
// hierpar::batch_norm_act.
#include "hierpar/nn/batch_norm.h"

#include "hierpar/enum_names.h"
#include "hierpar/ops.h"

#include <torch/nn/init.h>

#include <c10/util/Exception.h>

#include <type_traits>

namespace hierpar::nn {

namespace {
// The names hierpar::batch_norm_act takes for its activation argument.
constexpr EnumNames<Activation, 3> activation_names{
    {{Activation::identity, "identity"}, {Activation::relu, "relu"}, {Activation::leaky_relu, "leaky_relu"}}};

thread_local BatchNormSync* current_sync = nullptr;
}  // namespace

const char* to_string(Activation activation) { return name_of(activation_names, activation); }

BatchNormSync* batch_norm_sync() { return current_sync; }
BatchNormSyncGuard::BatchNormSyncGuard(BatchNormSync* sync) : previous_(current_sync) { current_sync = sync; }
BatchNormSyncGuard::~BatchNormSyncGuard() { current_sync = previous_; }

namespace detail {

namespace {
void check_slope(Activation activation, double negative_slope) {
  TORCH_CHECK(activation != Activation::leaky_relu || negative_slope > 0,
              "hierpar::nn::BatchNormAct2d: negative_slope: expected a positive slope for leaky_relu (the backward "
              "inverts the activation), got ",
              negative_slope);
}

// One tensor given to the constructor around existing tensors: present exactly when the options keep it
// (`kept_because` names the option), with `numel` elements.
void check_given(const char* layer, const char* name, const torch::Tensor& t, bool kept, const char* kept_because,
                 int64_t numel) {
  if (!kept) {
    TORCH_CHECK(!t.defined(), layer, ": ", name, ": expected none (", kept_because, " is false), got a tensor");
    return;
  }
  TORCH_CHECK(t.defined(), layer, ": ", name, ": expected a tensor (", kept_because, " is true), got none");
  TORCH_CHECK(t.numel() == numel && t.dim() <= 1, layer, ": ", name, ": expected ", numel,
              numel == 1 ? " element" : " elements (num_features)", ", got ", t.sizes());
}
}  // namespace

template <typename Derived>
BatchNormActImplBase<Derived>::BatchNormActImplBase(const torch::nn::BatchNorm2dOptions& options_,
                                                    Activation activation_, double negative_slope_)
    : options(options_), activation(activation_), negative_slope(negative_slope_) {
  check_slope(activation, negative_slope);
  // Cloneable::clone() calls reset() on the copy; the constructor does the same as torch::nn's.
  reset();
}

template <typename Derived>
BatchNormActImplBase<Derived>::BatchNormActImplBase(const torch::nn::BatchNorm2dOptions& options_,
                                                    Activation activation_, double negative_slope_,
                                                    const BatchNormTensors& given)
    : options(options_), activation(activation_), negative_slope(negative_slope_) {
  check_slope(activation, negative_slope);
  // name() is virtual: not callable from here.
  const char* layer =
      std::is_same_v<Derived, BatchNormAct2dImpl> ? "hierpar::nn::BatchNormAct2d" : "hierpar::nn::BatchNorm2d";
  const int64_t C = options.num_features();
  const bool affine = options.affine(), track = options.track_running_stats();
  check_given(layer, "weight", given.weight, affine, "affine", C);
  check_given(layer, "bias", given.bias, affine, "affine", C);
  check_given(layer, "running_mean", given.running_mean, track, "track_running_stats", C);
  check_given(layer, "running_var", given.running_var, track, "track_running_stats", C);
  check_given(layer, "num_batches_tracked", given.num_batches_tracked, track, "track_running_stats", 1);
  // The names and order of reset(), so that state dicts and named_parameters() list the same keys.
  auto grad = [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); };
  weight = this->register_parameter("weight", given.weight, grad(given.weight));
  bias = this->register_parameter("bias", given.bias, grad(given.bias));
  running_mean = this->register_buffer("running_mean", given.running_mean);
  running_var = this->register_buffer("running_var", given.running_var);
  num_batches_tracked = this->register_buffer("num_batches_tracked", given.num_batches_tracked);
}

template <typename Derived>
void BatchNormActImplBase<Derived>::reset() {
  if (options.affine()) {
    weight = this->register_parameter("weight", torch::empty({options.num_features()}));
    bias = this->register_parameter("bias", torch::empty({options.num_features()}));
  } else {
    weight = this->register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = this->register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = this->register_buffer("running_mean", torch::zeros({options.num_features()}));
    running_var = this->register_buffer("running_var", torch::ones({options.num_features()}));
    num_batches_tracked = this->register_buffer("num_batches_tracked", torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = this->register_buffer("running_mean", torch::Tensor());
    running_var = this->register_buffer("running_var", torch::Tensor());
    num_batches_tracked = this->register_buffer("num_batches_tracked", torch::Tensor());
  }
  reset_parameters();
}

template <typename Derived>
void BatchNormActImplBase<Derived>::reset_running_stats() {
  if (options.track_running_stats()) {
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

template <typename Derived>
void BatchNormActImplBase<Derived>::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

template <typename Derived>
void BatchNormActImplBase<Derived>::pretty_print(std::ostream& stream) const {
  stream << name() << "(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << (options.affine() ? "true" : "false")
         << ", track_running_stats=" << (options.track_running_stats() ? "true" : "false");
  if (activation == Activation::leaky_relu) {
    stream << ", activation=leaky_relu(" << negative_slope << ")";
  } else if (activation != Activation::identity || std::is_same_v<Derived, BatchNormAct2dImpl>) {
    stream << ", activation=" << to_string(activation);
  }
  stream << ")";
}

template <typename Derived>
torch::Tensor BatchNormActImplBase<Derived>::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() == 4, name(), ": input: expected a 4-d tensor (N, C, H, W), got ", input.dim(), "-d ",
              input.sizes());
  double momentum = options.momentum().value_or(0.0);
  BatchNormSync* sync = this->is_training() ? batch_norm_sync() : nullptr;
  const bool counting = this->is_training() && options.track_running_stats();
  // The op's kernel counts the batch (no launch of its own) unless the count is needed here first (for the
  // cumulative moving average's momentum, and before synchronized statistics) or the buffer is not the op's int64
  // scalar on the input's device (Module::to(dtype) converts integer buffers too).
  const bool op_counts = counting && options.momentum().has_value() && sync == nullptr &&
                         num_batches_tracked.scalar_type() == torch::kLong &&
                         num_batches_tracked.device() == input.device();
  if (counting && !op_counts) {
    num_batches_tracked.add_(1);
    if (!options.momentum().has_value()) {  // cumulative moving average, like torch::nn
      momentum = 1.0 / num_batches_tracked.template item<double>();
    }
  }
  if (sync != nullptr) {
    // Synchronized statistics (not the default): the activation is applied after, unfused.
    torch::Tensor y = sync->forward(input, weight, bias, running_mean, running_var, momentum, options.eps());
    switch (activation) {
      case Activation::identity: return y;
      case Activation::relu: return torch::relu(y);
      case Activation::leaky_relu: return torch::leaky_relu(y, negative_slope);
    }
  }
  // Batch statistics in training, and in eval when no running statistics are kept (like torch::nn).
  const bool use_batch_stats = this->is_training() || !options.track_running_stats();
  // Running statistics: updated in training, read in eval; not passed when not tracked.
  std::optional<torch::Tensor> rm, rv;
  if (options.track_running_stats()) {
    rm = running_mean;
    rv = running_var;
  }
  auto opt = [](const torch::Tensor& t) { return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt; };
  return std::get<0>(hierpar::ops::batch_norm_act(input, opt(weight), opt(bias), rm, rv, use_batch_stats, momentum,
                                                  options.eps(), to_string(activation), negative_slope,
                                                  op_counts ? opt(num_batches_tracked) : std::nullopt));
}

template class BatchNormActImplBase<BatchNormAct2dImpl>;
template class BatchNormActImplBase<BatchNorm2dImpl>;

}  // namespace detail
}  // namespace hierpar::nn
