// Suite "conv_transpose": hierpar::conv_transpose2d forward + backward against stock ATen/cuDNN
// (at::conv_transpose2d + at::convolution_backward, cudnn.benchmark on, TF32 allowed for convolutions) on
// the DCGAN generator's five layers, at batch 64 fp32 (NCHW and channels_last) and batch 1024 bf16
// channels_last. Both sides call the ops directly (no autograd), with the same gradient mask: the first
// layer's input (the noise) needs no gradient.
//  - "conv_transpose2d_fwd_bwd" (per layer) and "conv_transpose2d_generator_fwd_bwd" (the five layers back to
//    back): eager calls timed with CUDA events. At batch 64 a pass is a few microseconds of GPU work, so these
//    rows partly time the host's dispatch and launches.
//  - "conv_transpose2d_pass": forward, grad_input and grad_weight of the k4s2p1 layers, each alone, eager.
//  - "conv_transpose2d_fwd_bwd_graph" (per layer, and the generator with extra.layers = 5): the same calls
//    captured in a CUDA graph, as the training step runs them, where only GPU time counts: both sides warmed
//    eagerly first (cuDNN's benchmark search done before capture), then `calls` calls captured into one graph;
//    the median replay over `calls`, per call. The operands are the same tensors on every call (in L2 where
//    they fit, as the eager rows).
// extra.tflops: achieved TFLOP/s (forward, grad_weight and, when needed, grad_input as GEMMs).
// --batches 64 / 1024 runs the batch-64 (fp32) or the batch-1024 (bf16) settings only.
// HIERPAR_BENCH_PROFILE=<file>: each layer's forward + backward kernels by GPU time, stock and hierpar, appended
// there (a kineto profile of 10 eager calls; kernel durations are GPU time, host gaps excluded).
#include "bench.h"

#include "hierpar/ops.h"

#include <ATen/Context.h>
#include <ATen/ops/conv_transpose2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/rand.h>
#include <ATen/TensorOperators.h>

#include <array>
#include <fstream>
#include <iomanip>
#include <memory>
#include <functional>
#include <vector>

namespace {

using namespace hierpar::bench;

struct Layer {
  int64_t cin, cout, hw, stride, padding;
};
// The seed's DCGAN generator: 100 -> 256 at 1x1 -> 4x4, then kernel 4 stride 2 padding 1 doublings.
const std::vector<Layer> kGenerator{
    {100, 256, 1, 1, 0}, {256, 128, 4, 2, 1}, {128, 64, 8, 2, 1}, {64, 32, 16, 2, 1}, {32, 3, 32, 2, 1}};

struct Operands {
  at::Tensor x, w, go;
  Layer layer;
  bool needs_input_grad;
};

Operands make(const Layer& l, int64_t batch, at::ScalarType dtype, bool channels_last, bool first) {
  const auto fmt = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  auto opts = at::TensorOptions().dtype(dtype).device(at::kCUDA);
  const int64_t out_hw = (l.hw - 1) * l.stride - 2 * l.padding + 4;
  Operands o;
  o.x = (at::rand({batch, l.cin, l.hw, l.hw}, opts) * 2 - 1).contiguous(fmt);
  o.w = ((at::rand({l.cin, l.cout, 4, 4}, opts) * 2 - 1) * 0.05).contiguous(fmt);
  o.go = (at::rand({batch, l.cout, out_hw, out_hw}, opts) * 2 - 1).contiguous(fmt);
  o.layer = l;
  o.needs_input_grad = !first;
  return o;
}

void stock_step(const Operands& o) {
  const auto& l = o.layer;
  auto y = at::conv_transpose2d(o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding});
  at::convolution_backward(o.go, o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding}, {1, 1},
                           /*transposed=*/true, {0, 0}, 1, {o.needs_input_grad, true, false});
}

void hierpar_step(const Operands& o) {
  const auto& l = o.layer;
  auto y = hierpar::ops::conv_transpose2d(o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding});
  hierpar::ops::conv_transpose2d_backward(o.go, o.x, o.w, {l.stride, l.stride}, {l.padding, l.padding}, {0, 0}, 1,
                                          {1, 1}, {o.needs_input_grad, true, false});
}

// Multiply-adds x 2 of forward, grad_weight and (when needed) grad_input: each is one N*H*W*Cin*Cout*16 GEMM.
double flops(const Operands& o) {
  const double one = 2.0 * o.x.size(0) * o.layer.hw * o.layer.hw * o.layer.cin * o.layer.cout * 16;
  return one * (o.needs_input_grad ? 3 : 2);
}

void run_suite(Report& report, const Options& options) {
  at::globalContext().setBenchmarkCuDNN(true);
  at::globalContext().setAllowTF32CuDNN(true);
  const int warmup = options.quick ? 3 : 20, repeats = options.quick ? 10 : 100;
  const std::unique_ptr<std::ofstream> profile_out = profile_file();
  for (const ConvSetting& s : conv_settings()) {
    if (options.pick_batches({s.batch}).empty()) continue;  // --batches
    std::vector<Operands> layers;
    for (size_t i = 0; i < kGenerator.size(); ++i)
      layers.push_back(make(kGenerator[i], s.batch, s.dtype, s.channels_last, i == 0));
    const char* dtype = s.dtype == at::kFloat ? "float32" : "bfloat16";
    const char* layout = s.channels_last ? "channels_last" : "nchw";
    double total_flops = 0;
    for (const auto& o : layers) {
      Config config;
      config.set("shape", std::vector<int64_t>{s.batch, o.layer.cin, o.layer.hw, o.layer.hw})
          .set("out_channels", o.layer.cout)
          .set("kernel", int64_t(4))
          .set("stride", o.layer.stride)
          .set("padding", o.layer.padding)
          .set("dtype", dtype)
          .set("layout", layout)
          .set("grad_input", o.needs_input_grad);
      total_flops += flops(o);
      const Timing stock = time_cuda([&] { stock_step(o); }, warmup, repeats);
      const Timing ours = time_cuda([&] { hierpar_step(o); }, warmup, repeats);
      report.add("conv_transpose2d_fwd_bwd", "stock", config, stock,
                 Config().set("tflops", flops(o) / stock.median_us * 1e-6));
      report.add("conv_transpose2d_fwd_bwd", "hierpar", config, ours,
                 Config().set("tflops", flops(o) / ours.median_us * 1e-6));
      if (profile_out) {
        for (const bool hierpar : {false, true}) {
          const Profile p = profile([&] { hierpar ? hierpar_step(o) : stock_step(o); }, 10);
          *profile_out << "== " << (hierpar ? "hierpar" : "stock") << " " << config.to_text() << ": " << std::fixed
                       << std::setprecision(1) << p.kernels << " kernels, GPU busy " << p.busy_us << " us per call\n";
          write_kernels(*profile_out, p);
        }
      }
    }
    // Each pass alone on the k4s2p1 layers (where the time goes): forward, grad_input, grad_weight.
    for (size_t i = 1; i < layers.size(); ++i) {
      const auto& o = layers[i];
      const auto& l = o.layer;
      for (int pass = 0; pass < 3; ++pass) {
        static const char* kPass[3] = {"forward", "grad_input", "grad_weight"};
        Config config;
        config.set("shape", std::vector<int64_t>{s.batch, l.cin, l.hw, l.hw})
            .set("out_channels", l.cout)
            .set("dtype", dtype)
            .set("layout", layout)
            .set("pass", kPass[pass]);
        const std::array<bool, 3> mask{pass == 1, pass == 2, false};
        auto stock = [&] {
          if (pass == 0)
            at::conv_transpose2d(o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding});
          else
            at::convolution_backward(o.go, o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding},
                                     {1, 1}, true, {0, 0}, 1, mask);
        };
        auto ours = [&] {
          if (pass == 0)
            hierpar::ops::conv_transpose2d(o.x, o.w, std::nullopt, {l.stride, l.stride}, {l.padding, l.padding});
          else
            hierpar::ops::conv_transpose2d_backward(o.go, o.x, o.w, {l.stride, l.stride}, {l.padding, l.padding},
                                                    {0, 0}, 1, {1, 1}, mask);
        };
        const double f = flops(o) / (o.needs_input_grad ? 3 : 2);
        const Timing ts = time_cuda(stock, warmup, repeats), th = time_cuda(ours, warmup, repeats);
        report.add("conv_transpose2d_pass", "stock", config, ts, Config().set("tflops", f / ts.median_us * 1e-6));
        report.add("conv_transpose2d_pass", "hierpar", config, th, Config().set("tflops", f / th.median_us * 1e-6));
      }
    }
    Config config;
    config.set("batch", s.batch).set("dtype", dtype).set("layout", layout).set("layers", int64_t(layers.size()));
    auto stock_generator = [&] { for (const auto& o : layers) stock_step(o); };
    auto hierpar_generator = [&] { for (const auto& o : layers) hierpar_step(o); };
    const Timing stock = time_cuda(stock_generator, warmup, repeats);
    const Timing ours = time_cuda(hierpar_generator, warmup, repeats);
    report.add("conv_transpose2d_generator_fwd_bwd", "stock", config, stock,
               Config().set("tflops", total_flops / stock.median_us * 1e-6));
    report.add("conv_transpose2d_generator_fwd_bwd", "hierpar", config, ours,
               Config().set("tflops", total_flops / ours.median_us * 1e-6));

    // Graph-captured: GPU time only. 10 calls per graph at batch 64 (a replay of ~0.3-5 ms), 4 at batch 1024.
    const int calls = s.batch <= 64 ? 10 : 4, graph_repeats = options.quick ? 10 : 50;
    auto add_graph = [&](Config cfg, double f, const std::function<void()>& stock_call,
                         const std::function<void()>& hierpar_call) {
      cfg.set("calls_per_graph", int64_t(calls));
      auto timed = [&](const std::function<void()>& call) {
        for (int i = 0; i < 3; ++i) call();  // warm: cuDNN's benchmark search and hierpar's probe stay out of the graph
        return time_graph_per_call([&] { for (int i = 0; i < calls; ++i) call(); }, calls, graph_repeats);
      };
      const Timing ts = timed(stock_call), th = timed(hierpar_call);
      report.add("conv_transpose2d_fwd_bwd_graph", "stock", cfg, ts, Config().set("tflops", f / ts.median_us * 1e-6));
      report.add("conv_transpose2d_fwd_bwd_graph", "hierpar", cfg, th, Config().set("tflops", f / th.median_us * 1e-6));
    };
    for (const auto& o : layers) {
      Config cfg;
      cfg.set("shape", std::vector<int64_t>{s.batch, o.layer.cin, o.layer.hw, o.layer.hw})
          .set("out_channels", o.layer.cout)
          .set("dtype", dtype)
          .set("layout", layout)
          .set("grad_input", o.needs_input_grad)
          .set("layers", int64_t(1));
      add_graph(cfg, flops(o), [&] { stock_step(o); }, [&] { hierpar_step(o); });
    }
    add_graph(config, total_flops, stock_generator, hierpar_generator);
  }
}

HIERPAR_BENCH_SUITE("conv_transpose", run_suite);

}  // namespace
