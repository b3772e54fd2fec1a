// Suite "conv2d": hierpar::conv2d against stock ATen/cuDNN (at::conv2d + at::convolution_backward, cudnn.benchmark
// on, TF32 allowed for convolutions) on the DCGAN discriminator's first layer (3 -> 64, kernel 4, stride 2,
// padding 1, no bias, 64x64 -> 32x32), at batch 64 fp32 (NCHW and channels_last) and batch 1024 bf16
// channels_last: forward, grad_input, grad_weight each alone, and forward + backward (grad_input and grad_weight,
// as in a training step where the generator's pass needs the images' gradient). Then with the layer's LeakyReLU(0.2):
// forward (stock: at::conv2d + at::leaky_relu; hierpar: conv2d with the activation fused into its store) and
// forward + backward (both: at::leaky_relu_backward, whose mask comes from the pre-activation for stock and from the
// output for hierpar, then the convolution's backward). Both sides call the ops directly.
// Then "conv2d_fwd_bwd_graph": every convolution of the seed's discriminator (3 -> 32 -> 64 -> 128 -> 256 at kernel
// 4, stride 2, padding 1, then 256 -> 1 at kernel 4 over the 4x4 map), forward + backward (grad_input and
// grad_weight), each side's calls captured in a CUDA graph after an eager warm-up: GPU time, as a captured step.
// HIERPAR_BENCH_PROFILE=<file>: those layers' kernels by GPU time, stock and hierpar, appended there.
#include "bench.h"

#include "hierpar/ops.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/leaky_relu_backward.h>
#include <ATen/ops/rand.h>

#include <array>
#include <fstream>
#include <iomanip>
#include <memory>

namespace {

using namespace hierpar::bench;

constexpr int64_t kCin = 3, kCout = 64, kSize = 64;

void run_first_layer(Report& report, const Options& options) {
  at::globalContext().setBenchmarkCuDNN(true);
  at::globalContext().setAllowTF32CuDNN(true);
  const int warmup = options.quick ? 3 : 20, repeats = options.quick ? 10 : 100;
  for (const ConvSetting& s : conv_settings()) {
    const auto fmt = s.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const auto opts = at::TensorOptions().dtype(s.dtype).device(at::kCUDA);
    const at::Tensor x = (at::rand({s.batch, kCin, kSize, kSize}, opts) * 2 - 1).contiguous(fmt);
    const at::Tensor w = ((at::rand({kCout, kCin, 4, 4}, opts) * 2 - 1) * 0.05).contiguous(fmt);
    const at::Tensor gy = (at::rand({s.batch, kCout, kSize / 2, kSize / 2}, opts) * 2 - 1).contiguous(fmt);
    const char* dtype = s.dtype == at::kFloat ? "float32" : "bfloat16";
    const char* layout = s.channels_last ? "channels_last" : "nchw";
    // One pass is a N*32*32 x 64 x 48 GEMM.
    const double pass_flops = 2.0 * s.batch * (kSize / 2) * (kSize / 2) * kCout * kCin * 16;
    const at::Tensor ga = (at::rand({s.batch, kCout, kSize / 2, kSize / 2}, opts) * 2 - 1).contiguous(fmt);
    constexpr double kSlope = 0.2;
    static const char* kPass[6] = {"forward",           "grad_input",          "grad_weight",
                                   "forward_backward",  "forward_leaky_relu", "forward_backward_leaky_relu"};
    for (int pass = 0; pass < 6; ++pass) {
      Config config;
      config.set("shape", std::vector<int64_t>{s.batch, kCin, kSize, kSize})
          .set("out_channels", kCout)
          .set("kernel", int64_t(4))
          .set("stride", int64_t(2))
          .set("padding", int64_t(1))
          .set("dtype", dtype)
          .set("layout", layout)
          .set("pass", kPass[pass]);
      const std::array<bool, 3> mask{pass == 1 || pass == 3 || pass == 5, pass == 2 || pass == 3 || pass == 5, false};
      auto stock = [&] {
        if (pass >= 4) {
          const at::Tensor y = at::conv2d(x, w, {}, 2, 1);
          const at::Tensor a = at::leaky_relu(y, kSlope);
          if (pass == 5) {
            const at::Tensor g = at::leaky_relu_backward(ga, y, kSlope, /*self_is_result=*/false);
            at::convolution_backward(g, x, w, std::nullopt, {2, 2}, {1, 1}, {1, 1}, false, {0, 0}, 1, mask);
          }
          return;
        }
        if (pass == 0 || pass == 3) at::conv2d(x, w, {}, 2, 1);
        if (pass > 0) at::convolution_backward(gy, x, w, std::nullopt, {2, 2}, {1, 1}, {1, 1}, false, {0, 0}, 1, mask);
      };
      auto ours = [&] {
        if (pass >= 4) {
          const at::Tensor a = hierpar::ops::conv2d(x, w, std::nullopt, {2, 2}, {1, 1}, {1, 1}, 1, kSlope);
          if (pass == 5) {
            const at::Tensor g = at::leaky_relu_backward(ga, a, kSlope, /*self_is_result=*/true);
            hierpar::ops::conv2d_backward(g, x, w, {2, 2}, {1, 1}, {1, 1}, 1, mask);
          }
          return;
        }
        if (pass == 0 || pass == 3) hierpar::ops::conv2d(x, w, std::nullopt, {2, 2}, {1, 1});
        if (pass > 0) hierpar::ops::conv2d_backward(gy, x, w, {2, 2}, {1, 1}, {1, 1}, 1, mask);
      };
      const double f = pass_flops * (pass == 3 || pass == 5 ? 3 : 1);
      const Timing ts = time_cuda(stock, warmup, repeats), th = time_cuda(ours, warmup, repeats);
      report.add("conv2d_dcgan_first_layer", "stock", config, ts, Config().set("tflops", f / ts.median_us * 1e-6));
      report.add("conv2d_dcgan_first_layer", "hierpar", config, th, Config().set("tflops", f / th.median_us * 1e-6));
    }
  }
}

// Every convolution of the discriminator, forward + backward, graph-captured (see the file comment).
void run_discriminator_layers(Report& report, const Options& options) {
  struct Layer {
    int64_t cin, cout, size, stride, padding;
  };
  static constexpr Layer kDiscriminator[] = {{3, 32, 64, 2, 1}, {32, 64, 32, 2, 1}, {64, 128, 16, 2, 1},
                                             {128, 256, 8, 2, 1}, {256, 1, 4, 1, 0}};
  const std::unique_ptr<std::ofstream> profile_out = profile_file();
  for (const ConvSetting& s : conv_settings()) {
    const auto fmt = s.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const auto opts = at::TensorOptions().dtype(s.dtype).device(at::kCUDA);
    const int calls = s.batch <= 64 ? 10 : 4, repeats = options.quick ? 10 : 50;
    for (const Layer& l : kDiscriminator) {
      const int64_t out_size = (l.size + 2 * l.padding - 4) / l.stride + 1;
      const at::Tensor x = (at::rand({s.batch, l.cin, l.size, l.size}, opts) * 2 - 1).contiguous(fmt);
      const at::Tensor w = ((at::rand({l.cout, l.cin, 4, 4}, opts) * 2 - 1) * 0.05).contiguous(fmt);
      const at::Tensor gy = (at::rand({s.batch, l.cout, out_size, out_size}, opts) * 2 - 1).contiguous(fmt);
      const std::array<bool, 3> mask{true, true, false};
      const std::vector<int64_t> stride{l.stride, l.stride}, padding{l.padding, l.padding};
      auto stock = [&] {
        at::conv2d(x, w, {}, stride, padding);
        at::convolution_backward(gy, x, w, std::nullopt, stride, padding, {1, 1}, false, {0, 0}, 1, mask);
      };
      auto ours = [&] {
        hierpar::ops::conv2d(x, w, std::nullopt, stride, padding);
        hierpar::ops::conv2d_backward(gy, x, w, stride, padding, {1, 1}, 1, mask);
      };
      Config config;
      config.set("shape", std::vector<int64_t>{s.batch, l.cin, l.size, l.size})
          .set("out_channels", l.cout)
          .set("kernel", int64_t(4))
          .set("stride", l.stride)
          .set("padding", l.padding)
          .set("dtype", s.dtype == at::kFloat ? "float32" : "bfloat16")
          .set("layout", s.channels_last ? "channels_last" : "nchw")
          .set("calls_per_graph", int64_t(calls));
      const double f = 3 * 2.0 * s.batch * out_size * out_size * l.cout * l.cin * 16;
      for (const bool hierpar : {false, true}) {
        const std::function<void()> call = hierpar ? std::function<void()>(ours) : std::function<void()>(stock);
        for (int i = 0; i < 3; ++i) call();  // cuDNN's benchmark search and hierpar's probe stay out of the graph
        const Timing t = time_graph_per_call([&] { for (int i = 0; i < calls; ++i) call(); }, calls, repeats);
        report.add("conv2d_fwd_bwd_graph", hierpar ? "hierpar" : "stock", config, t,
                   Config().set("tflops", f / t.median_us * 1e-6));
        if (profile_out) {
          const Profile p = profile(call, 10);
          *profile_out << "== conv2d " << (hierpar ? "hierpar" : "stock") << " " << config.to_text() << ": "
                       << std::fixed << std::setprecision(1) << p.kernels << " kernels, GPU busy " << p.busy_us << " us per call\n";
          write_kernels(*profile_out, p);
        }
      }
    }
  }
}

void run_suite(Report& report, const Options& options) {
  run_first_layer(report, options);
  run_discriminator_layers(report, options);
}

HIERPAR_BENCH_SUITE("conv2d", run_suite);

}  // namespace
