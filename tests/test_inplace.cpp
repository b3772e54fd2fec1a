// In-place ops on a hierpar::nn layer's output behave as on the same torch::nn layer's: where stock's backward works,
// hierpar's gives the same output and gradients (the input's and every parameter's, float64 on the CPU, random odd
// shapes, batch 1, contiguous and channels_last, training and eval for the batch norms); where autograd refuses
// stock's backward (a tensor it saved was modified in place), it refuses hierpar's too.
//
// What each side saves decides it: torch's batch norm, convolutions and max pooling keep their input, so an in-place
// op on their output is fine; ReLU and LeakyReLU(inplace) keep their result, so an in-place op after them is refused.
// hierpar's BatchNorm2d keeps its input, BatchNormAct2d(relu) its input and output, BatchNormAct2d(leaky_relu) its
// output. The stock counterpart of BatchNormAct2d is BatchNorm2d followed by the activation as the seed's DCGAN
// writes it (inplace), and for relu also an out-of-place ReLU (which keeps its result too).
#include "testing.h"

#include "hierpar/nn.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace {

using hierpar::testing::coin;
using hierpar::testing::Layout;
using hierpar::testing::rand_int;
using hierpar::testing::random_tensor;
namespace tnn = torch::nn;
using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

constexpr const char* kInplaceError = "modified by an inplace operation";
// More elements than any output below has: the loss weights are its first elements, in the output's shape.
constexpr int64_t kMaxOutput = 8192;

struct InplaceOp {
  std::string name;
  Fn apply;
};

std::vector<InplaceOp> inplace_ops() {
  tnn::ReLU relu(tnn::ReLUOptions().inplace(true));
  tnn::LeakyReLU leaky(tnn::LeakyReLUOptions().negative_slope(0.2).inplace(true));
  return {{"torch::relu_",
           [](const torch::Tensor& y) {
             torch::Tensor handle = y;  // the same tensor: torch::relu_ takes a non-const reference
             return torch::relu_(handle);
           }},
          {"torch::nn::ReLU(inplace)", [relu](const torch::Tensor& y) mutable { return relu(y); }},
          {"torch::nn::LeakyReLU(0.2, inplace)", [leaky](const torch::Tensor& y) mutable { return leaky(y); }},
          {"add_(1)", [](const torch::Tensor& y) { return y.add_(1); }},
          {"mul_(2)", [](const torch::Tensor& y) { return y.mul_(2); }}};
}

// A hierpar layer and its stock counterpart with the same state, as modules (for the parameters and the train/eval
// flag) and as the calls that run them.
struct Pair {
  std::shared_ptr<tnn::Module> ours, stock;
  Fn run_ours, run_stock;
  std::vector<int64_t> input_sizes;
};

void copy_state(tnn::Module& to, const tnn::Module& from) {
  torch::NoGradGuard no_grad;
  const auto params = from.named_parameters(), buffers = from.named_buffers();
  for (auto& p : to.named_parameters()) p.value().copy_(params[p.key()]);
  for (auto& b : to.named_buffers()) b.value().copy_(buffers[b.key()]);
}

// Odd sizes, batch 1; at least 3x3 so that a training batch norm has several values per channel.
std::vector<int64_t> odd_input(int64_t channels) {
  return {1, channels, 2 * rand_int(1, 4) + 1, 2 * rand_int(1, 4) + 1};
}

// BatchNorm2d (activation identity) or BatchNormAct2d against torch::nn::BatchNorm2d followed by `stock_activation`.
template <typename Ours>
Pair batch_norm_pair(Ours ours, Fn stock_activation) {
  const int64_t c = ours->options.num_features();
  tnn::BatchNorm2d bn(c);
  bn->to(torch::kDouble);
  ours->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    bn->weight.copy_(random_tensor({c}, torch::kDouble).mul_(0.5).add_(1));
    bn->bias.copy_(random_tensor({c}, torch::kDouble));
    bn->running_mean.copy_(random_tensor({c}, torch::kDouble));
    bn->running_var.copy_(random_tensor({c}, torch::kDouble).mul_(0.4).add_(1));
  }
  copy_state(*ours, *bn);
  Fn stock = [bn, stock_activation](const torch::Tensor& x) mutable {
    const auto y = bn(x);
    return stock_activation ? stock_activation(y) : y;
  };
  return {ours.ptr(), bn.ptr(), [ours](const torch::Tensor& x) mutable { return ours(x); }, stock, odd_input(c)};
}

template <typename Ours, typename Stock>
Pair layer_pair(Ours ours, Stock stock, std::vector<int64_t> input_sizes) {
  ours->to(torch::kDouble);
  stock->to(torch::kDouble);
  copy_state(*ours, *stock);
  return {ours.ptr(), stock.ptr(), [ours](const torch::Tensor& x) mutable { return ours(x); },
          [stock](const torch::Tensor& x) mutable { return stock(x); }, std::move(input_sizes)};
}

// What one side's forward, in-place op and backward gave: the output and gradients, or autograd's error.
struct Outcome {
  std::optional<std::string> error;
  torch::Tensor output, grad_input;
  std::vector<std::pair<std::string, torch::Tensor>> grads;
};

// `weights`: the loss weights, flat (kMaxOutput elements).
Outcome run_side(const Fn& layer, const tnn::Module& module, const InplaceOp& op, const torch::Tensor& x,
                 const torch::Tensor& weights) {
  Outcome out;
  auto input = x.clone().requires_grad_();
  try {
    out.output = op.apply(layer(input));
    (out.output * weights.narrow(0, 0, out.output.numel()).view(out.output.sizes())).sum().backward();
  } catch (const c10::Error& e) {
    out.error = e.what_without_backtrace();
    return out;
  }
  out.grad_input = input.grad();
  for (const auto& p : module.named_parameters()) out.grads.emplace_back(p.key(), p.value().grad());
  return out;
}

void expect_scaled(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined() && expected.defined()) << what << ": a gradient is missing";
  const double scale = std::max(expected.abs().max().item<double>(), 1e-30);
  hierpar::testing::expect_close(actual, expected, {1e-10, 1e-10 * scale}, what);
}

// Every in-place op, both layouts and (batch norms) both modes, each on a fresh pair from `make`.
void check_every_op(const std::string& layer, const std::function<Pair()>& make, bool both_modes) {
  for (const auto& op : inplace_ops()) {
    for (Layout layout : {Layout::contiguous, Layout::channels_last}) {
      for (bool training : both_modes ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
        Pair pair = make();
        pair.ours->train(training);
        pair.stock->train(training);
        const std::string what = layer + " then " + op.name + ", float64, " + hierpar::testing::to_string(layout) +
                                 (training ? ", training" : ", eval") + ", input " +
                                 c10::str(at::IntArrayRef(pair.input_sizes));
        const auto x = random_tensor(pair.input_sizes, torch::kDouble, layout);
        const auto r = random_tensor({kMaxOutput}, torch::kDouble);
        const Outcome stock = run_side(pair.run_stock, *pair.stock, op, x, r);
        const Outcome ours = run_side(pair.run_ours, *pair.ours, op, x, r);
        if (stock.error) {
          ASSERT_NE(stock.error->find(kInplaceError), std::string::npos) << what << ": stock: " << *stock.error;
          EXPECT_TRUE(ours.error.has_value()) << what << ": stock's backward is refused, hierpar's ran";
          if (ours.error) {
            EXPECT_NE(ours.error->find(kInplaceError), std::string::npos) << what << ": " << *ours.error;
          }
          continue;
        }
        if (ours.error) {
          ADD_FAILURE() << what << ": stock ran, hierpar threw: " << *ours.error;
          continue;
        }
        expect_scaled(ours.output, stock.output, what + ": output");
        expect_scaled(ours.grad_input, stock.grad_input, what + ": grad_input");
        ASSERT_EQ(ours.grads.size(), stock.grads.size()) << what;
        for (size_t i = 0; i < ours.grads.size(); ++i) {
          ASSERT_EQ(ours.grads[i].first, stock.grads[i].first) << what;
          expect_scaled(ours.grads[i].second, stock.grads[i].second, what + ": grad of " + ours.grads[i].first);
        }
      }
    }
  }
}

Fn relu_module(bool inplace) {
  tnn::ReLU relu(tnn::ReLUOptions().inplace(inplace));
  return [relu](const torch::Tensor& y) mutable { return relu(y); };
}

Fn leaky_module(double slope, bool inplace) {
  tnn::LeakyReLU leaky(tnn::LeakyReLUOptions().negative_slope(slope).inplace(inplace));
  return [leaky](const torch::Tensor& y) mutable { return leaky(y); };
}

int64_t odd_channels() { return 2 * rand_int(0, 2) + 1; }

TEST(InPlace, AfterBatchNorm2d) {
  check_every_op(
      "hierpar::nn::BatchNorm2d", [] { return batch_norm_pair(hierpar::nn::BatchNorm2d(odd_channels()), {}); },
      /*both_modes=*/true);
}

TEST(InPlace, AfterBatchNormAct2dRelu) {
  for (bool inplace : {true, false}) {
    check_every_op(std::string("hierpar::nn::BatchNormAct2d(relu) vs BatchNorm2d + ReLU(inplace=") +
                       (inplace ? "true)" : "false)"),
                   [inplace] {
                     return batch_norm_pair(hierpar::nn::BatchNormAct2d(odd_channels(), hierpar::nn::Activation::relu),
                                            relu_module(inplace));
                   },
                   /*both_modes=*/true);
  }
}

TEST(InPlace, AfterBatchNormAct2dLeakyRelu) {
  check_every_op("hierpar::nn::BatchNormAct2d(leaky_relu 0.2) vs BatchNorm2d + LeakyReLU(0.2, inplace=true)",
                 [] {
                   return batch_norm_pair(
                       hierpar::nn::BatchNormAct2d(odd_channels(), hierpar::nn::Activation::leaky_relu, 0.2),
                       leaky_module(0.2, true));
                 },
                 /*both_modes=*/true);
}

TEST(InPlace, AfterConv2d) {
  check_every_op("hierpar::nn::Conv2d",
                 [] {
                   const int64_t c = odd_channels();
                   auto o = tnn::Conv2dOptions(c, odd_channels(), {rand_int(1, 3), rand_int(1, 3)})
                                .stride(rand_int(1, 2))
                                .padding(rand_int(0, 1))
                                .bias(coin());
                   return layer_pair(hierpar::nn::Conv2d(o), tnn::Conv2d(o), odd_input(c));
                 },
                 /*both_modes=*/false);
}

TEST(InPlace, AfterConvTranspose2d) {
  check_every_op("hierpar::nn::ConvTranspose2d",
                 [] {
                   const int64_t c = odd_channels();
                   auto o = tnn::ConvTranspose2dOptions(c, odd_channels(), {rand_int(1, 3), rand_int(1, 3)})
                                .stride(rand_int(1, 2))
                                .padding(rand_int(0, 1))
                                .bias(coin());
                   return layer_pair(hierpar::nn::ConvTranspose2d(o), tnn::ConvTranspose2d(o), odd_input(c));
                 },
                 /*both_modes=*/false);
}

TEST(InPlace, AfterMaxPool2d) {
  check_every_op("hierpar::nn::MaxPool2d",
                 [] {
                   const int64_t c = odd_channels();
                   auto o = tnn::MaxPool2dOptions(rand_int(2, 3)).stride(rand_int(1, 2)).ceil_mode(coin());
                   return layer_pair(hierpar::nn::MaxPool2d(o), tnn::MaxPool2d(o), odd_input(c));
                 },
                 /*both_modes=*/false);
}

// The one difference convert.h documents and convert avoids: after an out-of-place stock LeakyReLU (which keeps its
// input, the batch norm's output) an in-place op is fine, while BatchNormAct2d(leaky_relu) keeps its own output, so
// autograd refuses the same in-place op on it. convert therefore fuses a LeakyReLU(inplace=false) only where the
// next module reads its output without modifying it.
TEST(InPlace, AfterBatchNormAct2dLeakyReluAutogradRefusesWhatOutOfPlaceStockAllows) {
  for (const auto& op : inplace_ops()) {
    Pair pair = batch_norm_pair(hierpar::nn::BatchNormAct2d(odd_channels(), hierpar::nn::Activation::leaky_relu, 0.2),
                                leaky_module(0.2, false));
    const auto x = random_tensor(pair.input_sizes, torch::kDouble), r = random_tensor({kMaxOutput}, torch::kDouble);
    const Outcome stock = run_side(pair.run_stock, *pair.stock, op, x, r);
    const Outcome ours = run_side(pair.run_ours, *pair.ours, op, x, r);
    EXPECT_FALSE(stock.error.has_value()) << op.name << ": " << stock.error.value_or("");
    ASSERT_TRUE(ours.error.has_value()) << op.name;
    EXPECT_NE(ours.error->find(kInplaceError), std::string::npos) << op.name << ": " << *ours.error;
  }
}

}  // namespace
