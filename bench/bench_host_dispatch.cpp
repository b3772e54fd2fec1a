// Suite "host_dispatch" (runs without a GPU too): the host cost of one layer call that is not its kernels --
// the dispatcher, hierpar's Autograd kernel and backward node, argument checks, output allocation -- hierpar::nn's
// layer against the torch::nn layer it replaces, on CPU tensors so small that the kernels cost next to nothing
// (1 x 8 x 4 x 4). That part of a call is the same on the GPU, where the launches come on top
// (`hierpar-bench overhead` measures those, docs/overhead.md).
//  - bench "host_fwd": the forward in training mode on an input that needs gradients (a node recorded);
//  - bench "host_bwd": torch::autograd::grad of that output for the input and parameters.
//  - bench "host_step": one eager DCGAN training step with a model so small (nz 16, 32x32x1, width 0.125, batch
//    2) that its kernels cost little: stock's hand-written step on torch::nn layers against hierpar's
//    AdversarialTrainer on hierpar's layers; bench "host_step_trainer": the same stock step against the trainer on
//    the stock layers, i.e. what the trainer's own per-step work costs.
// timing: microseconds per call, the wall time of 2000 calls divided by 2000, median over 15 rounds, one thread.
#include "bench.h"
#include "dcgan_steps.h"

#include "hierpar/nn.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;

Timing per_call(const std::function<void()>& fn, int rounds, int calls) {
  return time_host(fn, rounds, calls, /*warmup_rounds=*/1);
}

struct Layer {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> parameters;
};

template <typename Holder>
Layer layer_of(Holder module, std::function<torch::Tensor(Holder&, const torch::Tensor&)> forward) {
  module->train();
  return {[module, forward](const torch::Tensor& x) mutable { return forward(module, x); }, module->parameters()};
}

struct Case {
  std::string name;
  std::function<Layer(bool hierpar)> make;
};

std::vector<Case> cases() {
  const auto k4s2p1t = torch::nn::ConvTranspose2dOptions(8, 8, 4).stride(2).padding(1).bias(false);
  const auto k4s2p1 = torch::nn::Conv2dOptions(8, 8, 4).stride(2).padding(1).bias(false);
  auto plain = [](auto& l, const torch::Tensor& x) { return l->forward(x); };
  return {
      {"MaxPool2d(2)",
       [=](bool h) -> Layer {
         if (h) return layer_of<hierpar::nn::MaxPool2d>(hierpar::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)), plain);
         return layer_of<torch::nn::MaxPool2d>(torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(2)), plain);
       }},
      {"BatchNorm2d + leaky_relu",
       [=](bool h) -> Layer {
         if (h) {
           return layer_of<hierpar::nn::BatchNormAct2d>(
               hierpar::nn::BatchNormAct2d(8, hierpar::nn::Activation::leaky_relu, 0.2), plain);
         }
         return layer_of<torch::nn::BatchNorm2d>(torch::nn::BatchNorm2d(8), [](auto& l, const torch::Tensor& x) {
           torch::Tensor y = l->forward(x);
           return torch::leaky_relu_(y, 0.2);
         });
       }},
      {"ConvTranspose2d k4s2p1",
       [=](bool h) -> Layer {
         if (h) return layer_of<hierpar::nn::ConvTranspose2d>(hierpar::nn::ConvTranspose2d(k4s2p1t), plain);
         return layer_of<torch::nn::ConvTranspose2d>(torch::nn::ConvTranspose2d(k4s2p1t), plain);
       }},
      {"Conv2d k4s2p1",
       [=](bool h) -> Layer {
         if (h) return layer_of<hierpar::nn::Conv2d>(hierpar::nn::Conv2d(k4s2p1), plain);
         return layer_of<torch::nn::Conv2d>(torch::nn::Conv2d(k4s2p1), plain);
       }},
  };
}

void run(Report& report, const Options& options) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const int rounds = options.quick ? 5 : 15, calls = options.quick ? 200 : 2000;
  for (const Case& c : cases()) {
    for (const bool hierpar : {false, true}) {
      torch::manual_seed(0);
      Layer layer = c.make(hierpar);
      const torch::Tensor x = torch::randn({1, 8, 4, 4}).requires_grad_(true);
      const Timing forward = per_call([&] { layer.forward(x); }, rounds, calls);
      const torch::Tensor y = layer.forward(x);
      const torch::Tensor grad_y = torch::randn_like(y);
      std::vector<torch::Tensor> wrt{x};
      for (const auto& p : layer.parameters) wrt.push_back(p);
      const Timing backward =
          per_call([&] { torch::autograd::grad({y}, wrt, {grad_y}, /*retain_graph=*/true); }, rounds, calls);
      Config config;
      config.set("layer", c.name).set("input", std::vector<int64_t>{1, 8, 4, 4}).set("device", "cpu");
      report.add("host_fwd", hierpar ? "hierpar" : "stock", config, forward);
      report.add("host_bwd", hierpar ? "hierpar" : "stock", config, backward);
    }
  }
  hierpar::models::DCGANOptions small;
  small.nz = 16;
  small.image_size = 32;
  small.channels = 1;
  small.width = 0.125;
  const int step_calls = options.quick ? 20 : 200;
  const auto time_step = [&](TrainingStep& step) { return per_call([&] { step.run(); }, rounds, step_calls); };
  Config config;
  config.set("model", small.shape_key()).set("batch", int64_t{2}).set("device", "cpu");
  torch::manual_seed(0);
  StockDcganStep stock(2, false, false, small, at::kCPU);
  TrainerStep trainer(2, false, false, false, hierpar::LayerSet::hierpar, small, at::kCPU);
  TrainerStep trainer_stock_layers(2, false, false, false, hierpar::LayerSet::stock, small, at::kCPU);
  const Timing stock_timing = time_step(stock);
  report.add("host_step", "stock", config, stock_timing);
  report.add("host_step", "hierpar", config, time_step(trainer));
  report.add("host_step_trainer", "stock", config, stock_timing);
  report.add("host_step_trainer", "hierpar", config, time_step(trainer_stock_layers),
             Config().set("hierpar_layers", false));
  at::set_num_threads(threads);
}

HIERPAR_BENCH_CPU_SUITE("host_dispatch", run);

}  // namespace
