// Suite "batch_norm_act": forward + backward of BatchNorm (training mode) followed by the activation, at the
// DCGAN layer shapes: discriminator layers with leaky_relu(0.2), generator layers with relu; batch 64 fp32
// NCHW, batch 64 fp32 and bf16 channels_last (the training step's tf32 and bf16 layouts) and batch 1024
// bf16 channels_last (fp32 parameters and statistics). `--batches 64` (or 1024) runs one batch size only.
//
//  - bench "batch_norm_act_fwd_bwd": through autograd, as a training step runs it. stock: at::batch_norm
//    (cuDNN where ATen picks it) then the in-place activation (DCGAN's inplace=True), then
//    torch::autograd::grad for input, weight and bias. hierpar: hierpar::ops::batch_norm_act, same grad.
//  - bench "batch_norm_act_fwd_bwd_ops": the kernels alone, no autograd: stock = batch norm forward +
//    activation + activation backward + batch norm backward with the FASTER of ATen's native kernels
//    (at::native_batch_norm[_backward]) and cuDNN's (at::cudnn_batch_norm[_backward]) at that shape, both
//    timed, their medians in extra.stock_native_us / stock_cudnn_us; hierpar the two ops.
//  - benches "batch_norm_act_fwd_graph" / "batch_norm_act_bwd_graph" (channels_last cases): each direction
//    alone, as the CUDA-graph training step runs it: the calls captured in a graph (at least 20 per graph),
//    median per call; impl "hierpar_split_path" is hierpar with HIERPAR_BN_CLUSTER=0 (the cooperative split
//    path instead of the cluster path, same process). Batch 1024: cycling through enough copies of the
//    inputs that each call finds its inputs out of L2 (>= 160 MB of other tensors in between). Batch 64: two
//    copies, so the inputs are in L2 as in the step, where the layer before has just written them (the
//    tensors are 0.5-8 MB).
//    stock forward: batch norm + in-place activation; stock backward: activation backward + batch norm
//    backward; batch norm is cuDNN's for float32 and ATen's native kernels for bfloat16 (cuDNN refuses bf16
//    input with fp32 parameters); extra.stock_backend says which. extra: compulsory_bytes (forward: read x,
//    write out = 2 T; backward: read dy and out, write dx = 3 T, relu also reads x: 4 T), tb_per_s (compulsory_bytes / median) and floor_us
//    (compulsory_bytes at the H200's measured 4.24 TB/s copy rate).
// extra.saved_activation_bytes: the per-layer activation memory autograd keeps for the backward.
//   stock: BN saves its input, the in-place activation its output: 2 tensors. hierpar: the output for
//   leaky_relu/identity (1 tensor), input + output for relu (2 tensors; see docs/batch_norm_act.md).
#include "bench.h"

#include "hierpar/ops.h"
#include "hierpar/switches.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;

struct BnCase {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  bool channels_last;
  const char* activation;  // "leaky_relu" (discriminator) or "relu" (generator)
};

std::vector<BnCase> cases(bool quick, const std::vector<int64_t>& batches) {
  const std::vector<std::vector<int64_t>> d{{64, 16, 16}, {128, 8, 8}, {256, 4, 4}};
  const std::vector<std::vector<int64_t>> g{{256, 4, 4}, {128, 8, 8}, {64, 16, 16}, {32, 32, 32}};
  std::vector<BnCase> out;
  for (auto [batch, dtype, cl] : {std::tuple{int64_t(64), at::kFloat, false}, std::tuple{int64_t(64), at::kFloat, true},
                                  std::tuple{int64_t(64), at::kBFloat16, true}, std::tuple{int64_t(1024), at::kBFloat16, true}}) {
    if (!batches.empty() && std::find(batches.begin(), batches.end(), batch) == batches.end()) continue;
    for (const auto& s : d) out.push_back({{batch, s[0], s[1], s[2]}, dtype, cl, "leaky_relu"});
    for (const auto& s : g) out.push_back({{batch, s[0], s[1], s[2]}, dtype, cl, "relu"});
    if (quick) break;
  }
  return out;
}

constexpr double kCopyBytesPerSecond = 4.24e12;  // H200, measured device-to-device copy (docs/batch_norm_act.md)

// Forward alone and backward alone, graph-captured, inputs out of L2 (see the file comment).
void time_directions(Report& report, const BnCase& c, const Config& config, bool quick) {
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  const bool leaky = std::string(c.activation) == "leaky_relu";
  const double slope = 0.2, eps = 1e-5, momentum = 0.1;
  const auto layout = c.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const auto opts = at::TensorOptions().device(at::kCUDA);
  const int64_t C = c.shape[1];
  const at::Tensor w = at::rand({C}, opts) + 0.5, b = at::rand({C}, opts) - 0.5;
  at::Tensor rm = at::zeros({C}, opts), rv = at::ones({C}, opts);
  int64_t numel = 1;
  for (int64_t s : c.shape) numel *= s;
  const double tensor_bytes = static_cast<double>(numel) * c10::elementSize(c.dtype);
  const bool warm = c.shape[0] <= 64;
  const int copies = warm ? 2 : static_cast<int>(std::max<double>(2, std::ceil(160e6 / tensor_bytes)));
  const int calls = std::max(copies, 20);
  // Stock at its strongest: cuDNN's batch norm for float32 (what at::batch_norm picks in the step), ATen's
  // native kernels for bfloat16 (cuDNN refuses bfloat16 input with float32 parameters).
  const bool cudnn = c.dtype == at::kFloat;
  struct Copy {
    at::Tensor x, dy, out, mean, invstd;               // hierpar
    at::Tensor s_out, s_mean, s_invstd, s_reserve;     // stock
  };
  std::vector<Copy> cs(copies);
  auto stock_forward = [&](Copy& k) {
    at::Tensor y;
    if (cudnn) std::tie(y, k.s_mean, k.s_invstd, k.s_reserve) = at::cudnn_batch_norm(k.x, w, b, rm, rv, true, momentum, eps);
    else std::tie(y, k.s_mean, k.s_invstd) = at::native_batch_norm(k.x, w, b, rm, rv, true, momentum, eps);
    return leaky ? at::leaky_relu_(y, slope) : at::relu_(y);
  };
  for (auto& k : cs) {
    k.x = (at::rand(c.shape, opts) * 4 - 1).to(c.dtype).contiguous(layout);
    k.dy = (at::rand(c.shape, opts) * 2 - 1).to(c.dtype).contiguous(layout);
    std::tie(k.out, k.mean, k.invstd) =
        hierpar::ops::batch_norm_act(k.x, w, b, rm, rv, true, momentum, eps, c.activation, slope);
    k.s_out = stock_forward(k);
  }
  const int repeats = quick ? 5 : 20;
  // `calls` calls per graph, cycling through the copies.
  auto each_call = [&](const std::function<void(Copy&)>& fn) {
    for (int i = 0; i < calls; ++i) fn(cs[i % copies]);
  };
  const Timing fwd_stock = time_graph_per_call([&] { each_call([&](Copy& k) { stock_forward(k); }); }, calls, repeats);
  auto fwd_hierpar = [&] {
    return time_graph_per_call([&] {
      each_call([&](Copy& k) { hierpar::ops::batch_norm_act(k.x, w, b, rm, rv, true, momentum, eps, c.activation, slope); });
    }, calls, repeats);
  };
  const Timing fwd_ours = fwd_hierpar();
  const Timing bwd_stock = time_graph_per_call([&] {
    each_call([&](Copy& k) {
      at::Tensor dyp = leaky ? at::leaky_relu_backward(k.dy, k.s_out, slope, true) : at::threshold_backward(k.dy, k.s_out, 0);
      if (cudnn) at::cudnn_batch_norm_backward(k.x, dyp, w, rm, rv, k.s_mean, k.s_invstd, eps, k.s_reserve);
      else at::native_batch_norm_backward(dyp, k.x, w, rm, rv, k.s_mean, k.s_invstd, true, eps, {true, true, true});
    });
  }, calls, repeats);
  auto bwd_hierpar = [&] {
    return time_graph_per_call([&] {
      each_call([&](Copy& k) {
        hierpar::ops::batch_norm_act_backward(k.dy, k.out, leaky ? std::optional<at::Tensor>() : std::optional<at::Tensor>(k.x),
                                              w, b, k.mean, k.invstd, true, eps, c.activation, slope, {true, true, true});
      });
    }, calls, repeats);
  };
  const Timing bwd_ours = bwd_hierpar();
  // The same calls on the cooperative split path (Switch::bn_cluster off): the same-process A/B of the cluster
  // path, which takes the tensors up to 8 MiB (docs/batch_norm_act.md).
  Timing fwd_split, bwd_split;
  {
    const hierpar::SwitchScope split(hierpar::Switch::bn_cluster, false);
    fwd_split = fwd_hierpar();
    bwd_split = bwd_hierpar();
  }

  auto add = [&](const char* bench, const char* impl, const Timing& t, double bytes) {
    const double floor_us = bytes / kCopyBytesPerSecond * 1e6;
    report.add(bench, impl, config, t,
               Config().set("compulsory_bytes", bytes).set("tb_per_s", bytes / (t.median_us * 1e-6) / 1e12)
                   .set("floor_us", floor_us).set("inputs_copies", int64_t(copies))
                   .set("stock_backend", cudnn ? "cudnn" : "native"));
  };
  const double fwd_bytes = 2 * tensor_bytes, bwd_bytes = (leaky ? 3 : 4) * tensor_bytes;
  add("batch_norm_act_fwd_graph", "stock", fwd_stock, fwd_bytes);
  add("batch_norm_act_fwd_graph", "hierpar", fwd_ours, fwd_bytes);
  add("batch_norm_act_bwd_graph", "stock", bwd_stock, bwd_bytes);
  add("batch_norm_act_bwd_graph", "hierpar", bwd_ours, bwd_bytes);
  add("batch_norm_act_fwd_graph", "hierpar_split_path", fwd_split, fwd_bytes);
  add("batch_norm_act_bwd_graph", "hierpar_split_path", bwd_split, bwd_bytes);
  auto line = [&](const char* dir, double bytes, const Timing& ours, const Timing& split, const Timing& stock) {
    std::printf("  %s %-18s %-8s %-10s hierpar %7.1f us %5.2f TB/s (%3.0f%% of floor %6.1f us) | split path %7.1f us"
                " | stock %7.1f us %5.2f TB/s\n",
                dir, c10::str(c10::IntArrayRef(c.shape)).c_str(), c.dtype == at::kFloat ? "float32" : "bfloat16",
                c.activation, ours.median_us,
                bytes / ours.median_us * 1e-6, 100 * bytes / kCopyBytesPerSecond * 1e6 / ours.median_us,
                bytes / kCopyBytesPerSecond * 1e6, split.median_us, stock.median_us, bytes / stock.median_us * 1e-6);
  };
  line("fwd", fwd_bytes, fwd_ours, fwd_split, fwd_stock);
  line("bwd", bwd_bytes, bwd_ours, bwd_split, bwd_stock);
  std::fflush(stdout);
}

void batch_norm_act_suite(Report& report, const Options& options) {
  const int repeats = options.quick ? 20 : 200;
  const double slope = 0.2, eps = 1e-5, momentum = 0.1;
  for (const auto& c : cases(options.quick, options.batches)) {
    const bool leaky = std::string(c.activation) == "leaky_relu";
    const auto layout = c.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const auto opts = at::TensorOptions().device(at::kCUDA);
    const int64_t C = c.shape[1];
    const at::Tensor x = (at::rand(c.shape, opts) * 4 - 1).to(c.dtype).contiguous(layout).requires_grad_();
    const at::Tensor dy = (at::rand(c.shape, opts) * 2 - 1).to(c.dtype).contiguous(layout);
    const at::Tensor w = (at::rand({C}, opts) + 0.5).requires_grad_(), b = (at::rand({C}, opts) - 0.5).requires_grad_();
    at::Tensor rm = at::zeros({C}, opts), rv = at::ones({C}, opts);

    auto stock_autograd = [&] {
      at::Tensor y = at::batch_norm(x, w, b, rm, rv, true, momentum, eps, /*cudnn_enabled=*/true);
      y = leaky ? at::leaky_relu_(y, slope) : at::relu_(y);
      torch::autograd::grad({y}, {x, w, b}, {dy});
    };
    auto ours_autograd = [&] {
      at::Tensor y = std::get<0>(hierpar::ops::batch_norm_act(x, w, b, rm, rv, true, momentum, eps, c.activation, slope));
      torch::autograd::grad({y}, {x, w, b}, {dy});
    };
    const at::Tensor xd = x.detach(), wd = w.detach(), bd = b.detach();
    auto stock_native_ops = [&] {
      auto [y, mean, invstd] = at::native_batch_norm(xd, wd, bd, rm, rv, true, momentum, eps);
      at::Tensor out = leaky ? at::leaky_relu(y, slope) : at::relu(y);
      at::Tensor dyp = leaky ? at::leaky_relu_backward(dy, out, slope, true) : at::threshold_backward(dy, out, 0);
      at::native_batch_norm_backward(dyp, xd, wd, rm, rv, mean, invstd, true, eps, {true, true, true});
    };
    auto stock_cudnn_ops = [&] {
      auto [y, mean, var, reserve] = at::cudnn_batch_norm(xd, wd, bd, rm, rv, true, momentum, eps);
      at::Tensor out = leaky ? at::leaky_relu(y, slope) : at::relu(y);
      at::Tensor dyp = leaky ? at::leaky_relu_backward(dy, out, slope, true) : at::threshold_backward(dy, out, 0);
      at::cudnn_batch_norm_backward(xd, dyp, wd, rm, rv, mean, var, eps, reserve);
    };
    bool have_cudnn = true;
    try {
      stock_cudnn_ops();
      c10::cuda::device_synchronize();
    } catch (const c10::Error& e) {
      have_cudnn = false;
      std::cout << "  (cuDNN batch norm not available at " << c10::IntArrayRef(c.shape) << ": "
                << e.what_without_backtrace() << ")\n";
    }
    auto ours_ops = [&] {
      at::AutoDispatchBelowADInplaceOrView no_autograd;
      auto [out, mean, invstd] = hierpar::ops::batch_norm_act(xd, wd, bd, rm, rv, true, momentum, eps, c.activation, slope);
      hierpar::ops::batch_norm_act_backward(dy, out, leaky ? std::optional<at::Tensor>() : std::optional<at::Tensor>(xd),
                                            wd, bd, mean, invstd, true, eps, c.activation, slope, {true, true, true});
    };

    // Sanity before timing: the same gradients as stock (bf16 tolerance covers both dtypes here).
    {
      at::Tensor ys = at::batch_norm(x, w, b, rm.clone(), rv.clone(), true, momentum, eps, true);
      ys = leaky ? at::leaky_relu(ys, slope) : at::relu(ys);
      auto gs = torch::autograd::grad({ys}, {x, w, b}, {dy});
      at::Tensor yo = std::get<0>(hierpar::ops::batch_norm_act(x, w, b, rm.clone(), rv.clone(), true, momentum, eps,
                                                                c.activation, slope));
      auto go = torch::autograd::grad({yo}, {x, w, b}, {dy});
      TORCH_CHECK(at::allclose(ys.to(at::kFloat), yo.to(at::kFloat), 3e-2, 3e-2), "batch_norm_act bench: outputs differ from stock");
      for (size_t i = 0; i < 3; ++i) {
        const double scale = gs[i].to(at::kFloat).abs().max().item<double>();
        TORCH_CHECK((gs[i].to(at::kFloat) - go[i].to(at::kFloat)).abs().max().item<double>() <= 3e-2 * scale + 1e-3,
                    "batch_norm_act bench: gradient ", i, " differs from stock");
      }
    }

    const double tensor_bytes = static_cast<double>(x.numel()) * x.element_size();
    Config config;
    config.set("shape", c.shape)
        .set("dtype", std::string(c.dtype == at::kFloat ? "float32" : "bfloat16"))
        .set("layout", c.channels_last ? "channels_last" : "nchw")
        .set("activation", std::string(c.activation) + (leaky ? "(0.2)" : ""));
    const Config stock_extra = Config().set("saved_activation_bytes", 2 * tensor_bytes);
    const Config ours_extra = Config().set("saved_activation_bytes", (leaky ? 1 : 2) * tensor_bytes);
    report.add("batch_norm_act_fwd_bwd", "stock", config, time_cuda(stock_autograd, 20, repeats), stock_extra);
    report.add("batch_norm_act_fwd_bwd", "hierpar", config, time_cuda(ours_autograd, 20, repeats), ours_extra);
    const Timing native = time_cuda(stock_native_ops, 20, repeats);
    Config ops_extra = stock_extra;
    ops_extra.set("stock_native_us", native.median_us);
    Timing best = native;
    std::string backend = "native";
    if (have_cudnn) {
      const Timing cudnn = time_cuda(stock_cudnn_ops, 20, repeats);
      ops_extra.set("stock_cudnn_us", cudnn.median_us);
      if (cudnn.median_us < native.median_us) {
        best = cudnn;
        backend = "cudnn";
      }
    }
    ops_extra.set("stock_backend", backend);
    report.add("batch_norm_act_fwd_bwd_ops", "stock", config, best, ops_extra);
    report.add("batch_norm_act_fwd_bwd_ops", "hierpar", config, time_cuda(ours_ops, 20, repeats), ours_extra);
    if (c.channels_last) time_directions(report, c, config, options.quick);
  }
}

HIERPAR_BENCH_SUITE("batch_norm_act", batch_norm_act_suite);

}  // namespace
