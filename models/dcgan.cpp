#include "hierpar/models/dcgan.h"

#include "hierpar/nn/recompute.h"

#include <torch/nn/init.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <sstream>

namespace hierpar::models {
namespace {

constexpr double kLeakySlope = 0.2;

// The negative slope of the networks' activations: D's LeakyReLU's, or none.
double activation_slope(nn::Activation activation) {
  return activation == nn::Activation::leaky_relu ? kLeakySlope : 0.0;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// A convolution, then its BatchNorm + activation (`norm`, if any), then tanh (G's output layer).
torch::Tensor apply_block(const Layer& conv, const Layer* norm, bool tanh, const torch::Tensor& x) {
  torch::Tensor y = conv.forward(x);
  if (norm != nullptr) y = norm->forward(y);
  return tanh ? torch::tanh(y) : y;
}

// apply_block, recomputed in the backward under `memory` (recompute, offload); `index` is the block's place in the
// network's forward; `own_input`: x was produced by this network (the noise and the images are kept by the caller
// anyway, so they are never offloaded). Without recomputation the layers run directly: nothing is copied on that
// path, which every default forward takes.
// With `slices` > 1 the backward runs in slices of the batch (nn::recompute_sliced); `activation` is the norm's.
torch::Tensor block(const Layer& conv, const Layer* norm, int64_t index, const torch::Tensor& x,
                    const DCGANOptions& options, bool own_input, nn::OffloadChain& chain, nn::Activation activation,
                    bool tanh = false) {
  const nn::ActivationMemory memory = options.memory;
  if (memory == nn::ActivationMemory::none ||
      (memory == nn::ActivationMemory::offload && chain.keeps_activations(index, x)))
    return apply_block(conv, norm, tanh, x);
  nn::OffloadChain* offload = memory == nn::ActivationMemory::offload && own_input ? &chain : nullptr;
  torch::Tensor y;
  if (options.memory_slices > 1) {
    std::optional<nn::BatchNormActOf> sliced_norm;
    if (norm != nullptr) sliced_norm = nn::BatchNormActOf::of(norm->module, activation, activation_slope(activation));
    y = nn::recompute_sliced(
        [conv, tanh](const torch::Tensor& in) { return apply_block(conv, nullptr, tanh, in); }, sliced_norm, x,
        {conv.module}, options.memory_slices, offload);
  } else {
    // The backward recomputes after this call has returned: the node keeps its own copies of the layers.
    std::vector<std::shared_ptr<torch::nn::Module>> modules{conv.module};
    std::optional<Layer> kept_norm;
    if (norm != nullptr) {
      kept_norm = *norm;
      modules.push_back(norm->module);
    }
    y = nn::recompute(
        [conv, kept_norm, tanh](const torch::Tensor& in) {
          return apply_block(conv, kept_norm ? &*kept_norm : nullptr, tanh, in);
        },
        x, modules, offload);
  }
  if (memory == nn::ActivationMemory::offload) chain.observe(index, x, y);
  return y;
}

// How both networks' reset() starts: the options checked, no layers yet and a fresh offload chain with the options'
// budget (a clone, a replica, chains its own blocks).
void start_reset(const DCGANOptions& options, std::vector<Layer>& convs, std::vector<Layer>& norms,
                 std::shared_ptr<nn::OffloadChain>& offload) {
  options.validate();
  offload = std::make_shared<nn::OffloadChain>();
  offload->budget = options.offload_budget;
  convs.clear();
  norms.clear();
}

}  // namespace

void DCGANOptions::validate() const {
  TORCH_CHECK(image_size == 32 || image_size == 64 || image_size == 128,
              "image_size: expected 32, 64 or 128, got ", image_size);
  TORCH_CHECK(channels == 1 || channels == 3, "channels: expected 1 or 3, got ", channels);
  TORCH_CHECK(nz >= 1, "nz: expected a positive noise dimension, got ", nz);
  TORCH_CHECK(offload_budget >= 0 && offload_budget <= 1, "offload_budget: expected a fraction in [0, 1], got ",
              offload_budget);
  TORCH_CHECK(memory_slices >= 1, "memory_slices: expected at least 1 slice of the batch, got ", memory_slices);
  TORCH_CHECK(memory_slices == 1 || memory != nn::ActivationMemory::none, "memory_slices: slices the backward of "
              "recomputed blocks; expected memory recompute or offload with ", memory_slices, " slices, got memory none");
  TORCH_CHECK(std::isfinite(width) && std::lround(32 * width) >= 1,
              "width: expected a multiplier giving at least 1 channel (width >= 1/64), got ", width);
}

std::vector<int64_t> DCGANOptions::hidden_channels() const {
  // Hidden layers at 4x4, 8x8, ..., image_size/2: log2(image_size) - 2 of them.
  int64_t layers = 0;
  for (int64_t s = 4; s < image_size; s *= 2) ++layers;
  const int64_t base = std::lround(32 * width);
  std::vector<int64_t> out;
  for (int64_t i = layers - 1; i >= 0; --i) out.push_back(base << i);
  return out;
}

std::string DCGANOptions::shape_key() const {
  std::ostringstream os;
  os << "nz=" << nz << " image_size=" << image_size << " channels=" << channels << " width=" << width;
  return os.str();
}

void dcgan_init(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_children()) {
    const std::string& name = item.key();
    auto& module = *item.value();
    for (const auto& param : module.named_parameters(/*recurse=*/false)) {
      const bool weight = param.key() == "weight";
      if (starts_with(name, "bn")) {
        weight ? torch::nn::init::normal_(param.value(), 1.0, 0.02) : torch::nn::init::zeros_(param.value());
      } else if (starts_with(name, "conv") || starts_with(name, "deconv")) {
        weight ? torch::nn::init::normal_(param.value(), 0.0, 0.02) : torch::nn::init::zeros_(param.value());
      }
    }
  }
}

GeneratorImpl::GeneratorImpl(DCGANOptions options_) : options(std::move(options_)) { reset(); }

void GeneratorImpl::reset() {
  start_reset(options, deconvs_, norms_, offload_);
  const auto hidden = options.hidden_channels();
  int64_t in = options.nz;
  for (size_t i = 0; i <= hidden.size(); ++i) {
    const bool last = i == hidden.size();
    const int64_t out = last ? options.channels : hidden[i];
    auto conv_options = torch::nn::ConvTranspose2dOptions(in, out, 4).bias(false);
    if (i == 0) {
      conv_options.stride(1).padding(0);
    } else {
      conv_options.stride(2).padding(1);
    }
    const std::string n = std::to_string(i + 1);
    deconvs_.push_back(make_conv_transpose2d(options.layers, conv_options));
    register_module("deconv" + n, deconvs_.back().module);
    if (!last) {
      norms_.push_back(make_batch_norm_act2d(options.layers, out, nn::Activation::relu, 0.0));
      register_module("bn" + n, norms_.back().module);
    }
    in = out;
  }
  dcgan_init(*this);
}

torch::Tensor GeneratorImpl::forward(const torch::Tensor& z) {
  TORCH_CHECK((z.dim() == 2 || (z.dim() == 4 && z.size(2) == 1 && z.size(3) == 1)) && z.size(1) == options.nz,
              "Generator: expected noise of shape [N, ", options.nz, "] or [N, ", options.nz, ", 1, 1], got ",
              z.sizes());
  auto x = z.dim() == 2 ? z.view({z.size(0), z.size(1), 1, 1}) : z;
  for (size_t i = 0; i < norms_.size(); ++i) {
    x = block(deconvs_[i], &norms_[i], static_cast<int64_t>(i), x, options, i > 0, *offload_, nn::Activation::relu);
  }
  return block(deconvs_.back(), nullptr, static_cast<int64_t>(norms_.size()), x, options, !norms_.empty(), *offload_,
               nn::Activation::identity, /*tanh=*/true);
}

DiscriminatorImpl::DiscriminatorImpl(DCGANOptions options_) : options(std::move(options_)) { reset(); }

void DiscriminatorImpl::reset() {
  start_reset(options, convs_, norms_, offload_);
  auto hidden = options.hidden_channels();
  std::reverse(hidden.begin(), hidden.end());  // image side first
  int64_t in = options.channels;
  for (size_t i = 0; i <= hidden.size(); ++i) {
    const bool last = i == hidden.size();
    const int64_t out = last ? 1 : hidden[i];
    auto conv_options = torch::nn::Conv2dOptions(in, out, 4).bias(false);
    if (last) {
      conv_options.stride(1).padding(0);
    } else {
      conv_options.stride(2).padding(1);
    }
    const std::string n = std::to_string(i + 1);
    // In the hierpar set, the first convolution (C_in = channels <= 3) is hierpar::nn::Conv2d with its LeakyReLU
    // fused; the wider ones stay torch::nn::Conv2d (make_conv2d decides, and says why).
    const auto activation = i == 0 ? std::optional<double>(kLeakySlope) : std::nullopt;
    convs_.push_back(make_conv2d(options.layers, conv_options, activation));
    register_module("conv" + n, convs_.back().module);
    if (i > 0 && !last) {
      norms_.push_back(make_batch_norm_act2d(options.layers, out, nn::Activation::leaky_relu, kLeakySlope));
      register_module("bn" + n, norms_.back().module);
    }
    in = out;
  }
  dcgan_init(*this);
}

torch::Tensor DiscriminatorImpl::forward(const torch::Tensor& images) {
  const int64_t s = options.image_size;
  TORCH_CHECK(images.dim() == 4 && images.size(1) == options.channels && images.size(2) == s && images.size(3) == s,
              "Discriminator: expected images of shape [N, ", options.channels, ", ", s, ", ", s, "], got ",
              images.sizes());
  // conv1 and its LeakyReLU
  auto x = block(convs_[0], nullptr, 0, images, options, false, *offload_, nn::Activation::identity);
  for (size_t i = 0; i < norms_.size(); ++i) {
    x = block(convs_[i + 1], &norms_[i], static_cast<int64_t>(i + 1), x, options, true, *offload_,
              nn::Activation::leaky_relu);
  }
  return convs_.back().forward(x).flatten();
}

}  // namespace hierpar::models
