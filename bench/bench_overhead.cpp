// Suite "overhead": what one eager call of each layer costs the host, hierpar's layer against the torch::nn layer it
// replaces (drop-in, same options), at the shapes of the seed's DCGAN (batch 64 and 1024) and of the seed CNN's
// pooling layer, in TF32 NCHW, TF32 channels_last and bf16 autocast channels_last.
//
//  - bench "overhead_fwd": the layer's forward (training mode, inputs that need gradients, as in a training step).
//  - bench "overhead_bwd": torch::autograd::grad of the layer's output for its input and parameters.
// timing: host microseconds per call: the wall time of enqueuing `kCalls` calls back to back after a device
// synchronisation, divided by kCalls, median over rounds; stock's and hierpar's rounds taken in turn. So few calls never fill CUDA's launch queue, so the time is
// the host's (dispatch, checks, allocations, launches), not the GPU's. extra.gpu_us: the GPU time of one call (CUDA
// events around it, median); extra.host_bound: host time > GPU time, i.e. an eager loop of this layer alone waits on
// the host.
//  - bench "overhead_adam": one step of Adam over the DCGAN generator's parameters (13 tensors, 3.6 M values):
//    hierpar::strategy::FusedAdam with hierpar's kernel (hierpar) or ATen's fused kernel (stock).
// Stock's BatchNorm + activation is torch::nn::BatchNorm2d then the in-place activation, as models' stock layer set
// writes it. hierpar's layers are hierpar::nn's, whatever the layer set's routing would pick.
#include "bench.h"

#include "hierpar/nn.h"
#include "hierpar/strategy/captured_step.h"
#include "hierpar/strategy/fused_adam.h"
#include "hierpar/strategy/precision.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/autograd.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;

constexpr int kCalls = 16;

// Host microseconds per call of fn (enqueue only): rounds of kCalls calls, each after a device synchronisation.
Timing host_time(const std::function<void()>& fn, int rounds) {
  return time_host(fn, rounds, kCalls, /*warmup_rounds=*/3, [] { c10::cuda::device_synchronize(); });
}

// "cudaLaunchKernel 3x 4.2us, ..." per call, by host time.
std::string runtime_text(const Profile& p) {
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> calls(p.runtime_calls.begin(), p.runtime_calls.end());
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  std::string text;
  char item[200];
  for (const auto& [name, entry] : calls) {
    std::snprintf(item, sizeof item, "%s%s %.1fx %.1fus", text.empty() ? "" : ", ", name.c_str(),
                  double(entry.first) / p.calls, entry.second / p.calls);
    text += item;
  }
  return text;
}

// A layer of one side: its forward, and the tensors its gradients are taken for (besides the input).
struct Side {
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> parameters;
};

struct LayerCase {
  std::string name;
  std::vector<int64_t> input;  // [N, C, H, W] with N set per batch
  std::function<Side(bool hierpar)> make;
};

template <typename Holder>
Side side_of(Holder layer, const std::function<torch::Tensor(Holder&, const torch::Tensor&)>& forward) {
  layer->to(torch::kCUDA);
  layer->train();
  std::vector<torch::Tensor> parameters = layer->parameters();
  return {[layer, forward](const torch::Tensor& x) mutable { return forward(layer, x); }, parameters};
}

Side conv_transpose(bool hierpar, const torch::nn::ConvTranspose2dOptions& o) {
  if (hierpar) {
    return side_of<hierpar::nn::ConvTranspose2d>(hierpar::nn::ConvTranspose2d(o),
                                                  [](auto& l, const torch::Tensor& x) { return l->forward(x); });
  }
  return side_of<torch::nn::ConvTranspose2d>(torch::nn::ConvTranspose2d(o),
                                             [](auto& l, const torch::Tensor& x) { return l->forward(x); });
}

Side conv(bool hierpar, const torch::nn::Conv2dOptions& o) {
  if (hierpar) {
    return side_of<hierpar::nn::Conv2d>(hierpar::nn::Conv2d(o), [](auto& l, const torch::Tensor& x) { return l->forward(x); });
  }
  return side_of<torch::nn::Conv2d>(torch::nn::Conv2d(o), [](auto& l, const torch::Tensor& x) { return l->forward(x); });
}

Side batch_norm_act(bool hierpar, int64_t channels, bool leaky) {
  if (hierpar) {
    return side_of<hierpar::nn::BatchNormAct2d>(
        hierpar::nn::BatchNormAct2d(channels, leaky ? hierpar::nn::Activation::leaky_relu : hierpar::nn::Activation::relu,
                                    0.2),
        [](auto& l, const torch::Tensor& x) { return l->forward(x); });
  }
  return side_of<torch::nn::BatchNorm2d>(torch::nn::BatchNorm2d(channels), [leaky](auto& l, const torch::Tensor& x) {
    torch::Tensor y = l->forward(x);
    return leaky ? torch::leaky_relu_(y, 0.2) : torch::relu_(y);
  });
}

Side max_pool(bool hierpar) {
  const auto o = torch::nn::MaxPool2dOptions(2);
  if (hierpar) {
    return side_of<hierpar::nn::MaxPool2d>(hierpar::nn::MaxPool2d(o), [](auto& l, const torch::Tensor& x) { return l->forward(x); });
  }
  return side_of<torch::nn::MaxPool2d>(torch::nn::MaxPool2d(o), [](auto& l, const torch::Tensor& x) { return l->forward(x); });
}

std::vector<LayerCase> layer_cases() {
  using CT = torch::nn::ConvTranspose2dOptions;
  using C = torch::nn::Conv2dOptions;
  const auto k4s2p1t = [](int64_t in, int64_t out) { return CT(in, out, 4).stride(2).padding(1).bias(false); };
  const auto k4s2p1 = [](int64_t in, int64_t out) { return C(in, out, 4).stride(2).padding(1).bias(false); };
  std::vector<LayerCase> cases;
  cases.push_back({"G convT 100->512 k4s1p0", {0, 100, 1, 1}, [](bool h) { return conv_transpose(h, CT(100, 512, 4).bias(false)); }});
  cases.push_back({"G convT 512->256 k4s2p1", {0, 512, 4, 4}, [=](bool h) { return conv_transpose(h, k4s2p1t(512, 256)); }});
  cases.push_back({"G convT 128->64 k4s2p1", {0, 128, 16, 16}, [=](bool h) { return conv_transpose(h, k4s2p1t(128, 64)); }});
  cases.push_back({"G convT 64->3 k4s2p1", {0, 64, 32, 32}, [=](bool h) { return conv_transpose(h, k4s2p1t(64, 3)); }});
  cases.push_back({"G BN+relu 512@4x4", {0, 512, 4, 4}, [](bool h) { return batch_norm_act(h, 512, false); }});
  cases.push_back({"G BN+relu 64@32x32", {0, 64, 32, 32}, [](bool h) { return batch_norm_act(h, 64, false); }});
  cases.push_back({"D conv 3->64 k4s2p1", {0, 3, 64, 64}, [=](bool h) { return conv(h, k4s2p1(3, 64)); }});
  cases.push_back({"D conv 128->256 k4s2p1", {0, 128, 16, 16}, [=](bool h) { return conv(h, k4s2p1(128, 256)); }});
  cases.push_back({"D conv 512->1 k4s1p0", {0, 512, 4, 4}, [](bool h) { return conv(h, C(512, 1, 4).bias(false)); }});
  cases.push_back({"D BN+leaky 128@16x16", {0, 128, 16, 16}, [](bool h) { return batch_norm_act(h, 128, true); }});
  cases.push_back({"D BN+leaky 512@4x4", {0, 512, 4, 4}, [](bool h) { return batch_norm_act(h, 512, true); }});
  cases.push_back({"CNN maxpool 2 10@26x26", {0, 10, 26, 26}, [](bool h) { return max_pool(h); }});
  return cases;
}

// Host time of `stock` and `hierpar` in alternating rounds (stock, hierpar, stock, ...): a shared host's speed drifts
// by tens of percent over seconds, and rounds taken in turn see the same drift.
std::pair<Timing, Timing> paired_host_time(const std::function<void()>& stock, const std::function<void()>& hierpar,
                                           int rounds) {
  const auto sync = [] { c10::cuda::device_synchronize(); };
  for (int i = 0; i < 3; ++i) time_host(stock, 1, kCalls, 0, sync), time_host(hierpar, 1, kCalls, 0, sync);
  std::vector<double> a, b;
  for (int i = 0; i < rounds; ++i) {
    a.push_back(time_host(stock, 1, kCalls, 0, sync).median_us);
    b.push_back(time_host(hierpar, 1, kCalls, 0, sync).median_us);
  }
  const auto summary = [rounds](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return Timing{v[v.size() / 2], v.front(), rounds};
  };
  return {summary(a), summary(b)};
}

// One side's layer with its input, output and the gradient its backward is timed with.
struct Prepared {
  Side side;
  torch::Tensor x, y, grad_y;
  std::vector<torch::Tensor> wrt;
  std::function<void()> forward, backward;
};

void run(Report& report, const Options& options) {
  namespace hs = hierpar::strategy;
  const std::vector<hs::StepPrecision> precisions{hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CUDA),
                                                  hs::StepPrecision::from_flags("tf32", true, c10::DeviceType::CUDA),
                                                  hs::StepPrecision::from_flags("bf16", true, c10::DeviceType::CUDA)};
  const int rounds = options.quick ? 5 : 25;
  for (const int64_t batch : options.any_batches({64, 1024})) {
    for (const hs::StepPrecision& precision : precisions) {
      const hs::PrecisionScope tf32(precision);
      for (const LayerCase& layer : layer_cases()) {
        std::vector<int64_t> shape = layer.input;
        shape[0] = batch;
        hierpar::strategy::AutocastScope autocast(at::kCUDA, precision.autocast_dtype());
        std::vector<std::unique_ptr<Prepared>> sides;
        for (const bool hierpar : {false, true}) {
          torch::manual_seed(0);
          auto p = std::make_unique<Prepared>();
          p->side = layer.make(hierpar);
          p->x = torch::randn(shape, torch::kCUDA);
          if (precision.channels_last) p->x = p->x.contiguous(at::MemoryFormat::ChannelsLast);
          p->x.requires_grad_(true);
          Prepared* q = p.get();
          p->forward = [q] { q->side.forward(q->x); };
          p->y = p->side.forward(p->x);
          p->grad_y = torch::randn_like(p->y);
          p->wrt = {p->x};
          for (const torch::Tensor& t : p->side.parameters) p->wrt.push_back(t);
          p->backward = [q] { torch::autograd::grad({q->y}, q->wrt, {q->grad_y}, /*retain_graph=*/true); };
          sides.push_back(std::move(p));
        }
        const auto [stock_forward, hierpar_forward] = paired_host_time(sides[0]->forward, sides[1]->forward, rounds);
        const auto [stock_backward, hierpar_backward] = paired_host_time(sides[0]->backward, sides[1]->backward, rounds);
        for (const bool hierpar : {false, true}) {
          Prepared& p = *sides[hierpar ? 1 : 0];
          const Timing& forward_host = hierpar ? hierpar_forward : stock_forward;
          const Timing& backward_host = hierpar ? hierpar_backward : stock_backward;
          const Timing forward_gpu = time_cuda(p.forward, 5, rounds);
          const Timing backward_gpu = time_cuda(p.backward, 5, rounds);
          // What the host did in a call, by CUDA runtime/driver call (count per call, host us per call), and the
          // kernels launched: at batch 64 only (the same calls at every batch).
          std::string calls_forward, calls_backward;
          double kernels_forward = 0, kernels_backward = 0;
          if (batch == 64) {
            const Profile pf = profile(p.forward, 4);
            const Profile pb = profile(p.backward, 4);
            calls_forward = runtime_text(pf);
            calls_backward = runtime_text(pb);
            kernels_forward = pf.kernels;
            kernels_backward = pb.kernels;
          }
          Config config;
          config.set("layer", layer.name).set("batch", batch).set("precision", precision.name())
              .set("channels_last", precision.channels_last);
          const char* impl = hierpar ? "hierpar" : "stock";
          report.add("overhead_fwd", impl, config, forward_host,
                     Config().set("gpu_us", forward_gpu.median_us).set("host_bound", forward_host.median_us > forward_gpu.median_us)
                         .set("kernels", kernels_forward).set("runtime_calls", calls_forward));
          report.add("overhead_bwd", impl, config, backward_host,
                     Config().set("gpu_us", backward_gpu.median_us).set("host_bound", backward_host.median_us > backward_gpu.median_us)
                         .set("kernels", kernels_backward).set("runtime_calls", calls_backward));
        }
      }
    }
  }
}

// The generator's parameters: its transposed convolutions' weights and its BatchNorms' weights and biases.
void adam(Report& report, int rounds) {
  const std::vector<std::vector<int64_t>> shapes{{100, 512, 4, 4}, {512}, {512}, {512, 256, 4, 4}, {256}, {256},
                                                 {256, 128, 4, 4}, {128}, {128}, {128, 64, 4, 4}, {64}, {64},
                                                 {64, 3, 4, 4}};
  std::vector<std::unique_ptr<hierpar::strategy::FusedAdam>> optimizers;
  for (const bool hierpar : {false, true}) {
    torch::manual_seed(0);
    std::vector<torch::Tensor> parameters;
    for (const auto& shape : shapes) {
      parameters.push_back(torch::randn(shape, torch::kCUDA).requires_grad_(true));
      parameters.back().mutable_grad() = torch::randn(shape, torch::kCUDA);
    }
    optimizers.push_back(std::make_unique<hierpar::strategy::FusedAdam>(
        parameters, torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}),
        hierpar ? hierpar::strategy::AdamKernel::hierpar : hierpar::strategy::AdamKernel::aten));
  }
  const std::function<void()> stock_step = [&] { optimizers[0]->step(); };
  const std::function<void()> hierpar_step = [&] { optimizers[1]->step(); };
  const auto [stock_host, hierpar_host] = paired_host_time(stock_step, hierpar_step, rounds);
  for (const bool hierpar : {false, true}) {
    const std::function<void()>& step = hierpar ? hierpar_step : stock_step;
    const Timing& host = hierpar ? hierpar_host : stock_host;
    const Timing gpu = time_cuda(step, 5, rounds);
    report.add("overhead_adam", hierpar ? "hierpar" : "stock", Config().set("network", "DCGAN G"), host,
               Config().set("gpu_us", gpu.median_us).set("host_bound", host.median_us > gpu.median_us));
  }
}

void run_all(Report& report, const Options& options) {
  run(report, options);
  adam(report, options.quick ? 5 : 25);
}

HIERPAR_BENCH_SUITE("overhead", run_all);

}  // namespace
