// Suite "fused_adam": one Adam update of a network's parameters, stock ATen (at::_fused_adam_, what
// torch.optim.Adam(fused=True) runs) against hierpar::fused_adam_, fp32 parameters with fp32 moments.
//
// Cases: the seed DCGAN's generator and discriminator (the training step's optimisers) and a 25M-parameter
// list of ResNet-50-like sizes, where ATen's 65536-element chunks already give enough blocks.
// extra.effective_gb_s: the 28 bytes an fp32 element moves (read param, grad, two moments; write param, two
// moments) over the median time, to compare with the GPU's memory bandwidth.
#include "bench.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;

struct AdamState {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;

  explicit AdamState(const std::vector<std::vector<int64_t>>& shapes) {
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
    for (const auto& shape : shapes) {
      params.push_back(at::randn(shape, options));
      grads.push_back(at::randn(shape, options));
      exp_avgs.push_back(at::randn(shape, options) * 0.1);
      exp_avg_sqs.push_back(at::rand(shape, options) * 0.01);
      steps.push_back(at::full({}, 3.0, options));
    }
  }
  AdamState(const AdamState& other) {
    auto copy = [](const std::vector<at::Tensor>& from) {
      std::vector<at::Tensor> to;
      for (const auto& t : from) to.push_back(t.clone());
      return to;
    };
    params = copy(other.params), grads = copy(other.grads), exp_avgs = copy(other.exp_avgs);
    exp_avg_sqs = copy(other.exp_avg_sqs), steps = copy(other.steps);
  }
};

// DCGAN's Adam: lr 2e-4, betas (0.5, 0.999).
constexpr double kLr = 2e-4, kBeta1 = 0.5, kBeta2 = 0.999, kEps = 1e-8, kWeightDecay = 0.0;

void stock_update(AdamState& s) {
  at::_fused_adam_(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, s.steps, kLr, kBeta1, kBeta2, kWeightDecay, kEps,
                   /*amsgrad=*/false, /*maximize=*/false);
}

void hierpar_update(AdamState& s) {
  hierpar::ops::fused_adam_(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, s.steps, kLr, kBeta1, kBeta2,
                            kWeightDecay, kEps, /*amsgrad=*/false);
}

std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : tensors) shapes.push_back(t.sizes().vec());
  return shapes;
}

// Conv weights of ResNet-50's stages (with their BatchNorm pairs) and its classifier: 25.5M elements.
std::vector<std::vector<int64_t>> resnet50_like_shapes() {
  std::vector<std::vector<int64_t>> shapes = {{64, 3, 7, 7}, {64}, {64}};
  const int64_t widths[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  int64_t in = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t w = widths[stage], out = 4 * w;
    for (int64_t b = 0; b < blocks[stage]; ++b) {
      for (const auto& s : std::vector<std::vector<int64_t>>{{w, in, 1, 1}, {w, w, 3, 3}, {out, w, 1, 1}}) {
        shapes.push_back(s);
        shapes.push_back({s[0]});
        shapes.push_back({s[0]});
      }
      if (b == 0) shapes.push_back({out, in, 1, 1});
      in = out;
    }
  }
  shapes.push_back({1000, 2048});
  shapes.push_back({1000});
  return shapes;
}

void fused_adam_suite(Report& report, const Options& options) {
  hierpar::models::DCGANOptions model;  // the seed's
  const hierpar::models::Generator generator(model);
  const hierpar::models::Discriminator discriminator(model);
  struct Case {
    std::string what;
    std::vector<std::vector<int64_t>> shapes;
  };
  const std::vector<Case> cases = {{"DCGAN generator", shapes_of(generator->parameters())},
                                   {"DCGAN discriminator", shapes_of(discriminator->parameters())},
                                   {"ResNet-50-like", resnet50_like_shapes()}};
  const int repeats = options.quick ? 20 : 200;
  for (const auto& c : cases) {
    const AdamState initial(c.shapes);
    AdamState stock(initial), ours(initial);
    // Sanity before timing: one update of each from the same state agrees to fp32 rounding.
    stock_update(stock);
    hierpar_update(ours);
    for (size_t i = 0; i < initial.params.size(); ++i) {
      TORCH_CHECK(at::allclose(stock.params[i], ours.params[i], 1e-5, 1e-6) &&
                      at::allclose(stock.exp_avg_sqs[i], ours.exp_avg_sqs[i], 1e-5, 1e-9),
                  "fused_adam bench: ", c.what, " tensor ", i, ": hierpar's update differs from ATen's");
    }
    int64_t elements = 0;
    for (const auto& p : initial.params) elements += p.numel();
    // The update is repeated on the same state; the values drift slowly (lr 2e-4), which does not change the work.
    const Timing t_stock = time_cuda([&] { stock_update(stock); }, 20, repeats);
    const Timing t_ours = time_cuda([&] { hierpar_update(ours); }, 20, repeats);
    Config config;
    config.set("case", c.what).set("tensors", static_cast<int64_t>(c.shapes.size())).set("elements", elements)
        .set("dtype", "float32");
    auto extra = [&](const Timing& t) {
      Config e;
      e.set("effective_gb_s", 28.0 * static_cast<double>(elements) / (t.median_us * 1e3));
      return e;
    };
    report.add("fused_adam", "stock", config, t_stock, extra(t_stock));
    report.add("fused_adam", "hierpar", config, t_ours, extra(t_ours));
  }
}

}  // namespace

HIERPAR_BENCH_SUITE("fused_adam", fused_adam_suite);
