// Suite "max_pool": forward + backward of max pooling, stock ATen (at::max_pool2d_with_indices, int64 indices,
// scatter backward into a zeroed grad_input) against hierpar (uint8 window offsets, gather backward).
//
// extra.effective_gb_s divides the bytes that a uint8-index, write-once implementation must move (read input,
// write output and indices; read grad_output and indices, write grad_input) by the median time, for both
// implementations, so it compares to the GPU's memory bandwidth.
#include "bench.h"

#include "hierpar/ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;

struct PoolBenchCase {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  bool channels_last;
  int64_t kernel;
  const char* what;
};

void max_pool_suite(Report& report, const Options& options) {
  const std::vector<PoolBenchCase> cases = {
      {{64, 64, 64, 64}, at::kFloat, false, 2, "issue target"},
      {{128, 10, 26, 26}, at::kFloat, false, 2, "seed CNN (conv3x3(10) -> maxpool2 on MNIST, batch 128)"},
      {{64, 64, 64, 64}, at::kBFloat16, true, 2, "channels_last bf16"},
  };
  const int repeats = options.quick ? 20 : 200;
  for (const auto& c : cases) {
    const auto layout = c.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(c.dtype);
    const at::Tensor x = (at::rand(c.shape, opts.dtype(at::kFloat)) * 2 - 1).to(c.dtype).contiguous(layout);
    const std::vector<int64_t> k{c.kernel, c.kernel}, pad{0, 0}, dil{1, 1};

    auto [out_stock, idx_stock] = at::max_pool2d_with_indices(x, k, k, pad, dil, false);
    auto [out_ours, idx_ours] = hierpar::ops::max_pool2d(x, k, k, pad, dil, false);
    const at::Tensor grad_out = (at::rand(out_stock.sizes(), opts.dtype(at::kFloat)) * 2 - 1).to(c.dtype)
                                    .contiguous(layout);
    // Sanity before timing: the same selection and the same gradient.
    TORCH_CHECK(out_stock.equal(out_ours), "max_pool bench: hierpar's output differs from ATen's");
    TORCH_CHECK(at::max_pool2d_with_indices_backward(grad_out, x, k, k, pad, dil, false, idx_stock)
                    .equal(hierpar::ops::max_pool2d_backward(grad_out, idx_ours, x.sizes(), k, k, pad, dil, false)),
                "max_pool bench: hierpar's grad_input differs from ATen's");

    auto stock_forward = [&] { return at::max_pool2d_with_indices(x, k, k, pad, dil, false); };
    auto ours_forward = [&] { return hierpar::ops::max_pool2d(x, k, k, pad, dil, false); };
    auto stock_backward = [&](const at::Tensor& i) {
      at::max_pool2d_with_indices_backward(grad_out, x, k, k, pad, dil, false, i);
    };
    auto ours_backward = [&](const at::Tensor& i) {
      hierpar::ops::max_pool2d_backward(grad_out, i, x.sizes(), k, k, pad, dil, false);
    };
    const Timing stock = time_cuda([&] { stock_backward(std::get<1>(stock_forward())); }, 20, repeats);
    const Timing ours = time_cuda([&] { ours_backward(std::get<1>(ours_forward())); }, 20, repeats);
    // The two halves alone, for the notes in docs/max_pool.md.
    const Timing stock_fwd = time_cuda([&] { stock_forward(); }, 20, repeats);
    const Timing ours_fwd = time_cuda([&] { ours_forward(); }, 20, repeats);
    const Timing stock_bwd = time_cuda([&] { stock_backward(idx_stock); }, 20, repeats);
    const Timing ours_bwd = time_cuda([&] { ours_backward(idx_ours); }, 20, repeats);

    const double in_bytes = static_cast<double>(x.nbytes()), out_bytes = static_cast<double>(out_stock.nbytes());
    const double windows = static_cast<double>(out_stock.numel());
    const double min_bytes = 2 * in_bytes + 2 * out_bytes + 2 * windows;  // fwd + bwd, 1-byte indices
    Config config;
    config.set("shape", c.shape)
        .set("dtype", std::string(c.dtype == at::kFloat ? "float32" : "bfloat16"))
        .set("layout", c.channels_last ? "channels_last" : "nchw")
        .set("kernel", c.kernel);
    auto extra = [&](const Timing& t) {
      Config e;
      e.set("case", c.what).set("min_bytes", min_bytes).set("effective_gb_s", min_bytes / (t.median_us * 1e3));
      return e;
    };
    report.add("max_pool2d_fwd_bwd", "stock", config, stock, extra(stock));
    report.add("max_pool2d_fwd_bwd", "hierpar", config, ours, extra(ours));
    report.add("max_pool2d_fwd", "stock", config, stock_fwd);
    report.add("max_pool2d_fwd", "hierpar", config, ours_fwd);
    report.add("max_pool2d_bwd", "stock", config, stock_bwd);
    report.add("max_pool2d_bwd", "hierpar", config, ours_bwd);
  }
}

HIERPAR_BENCH_SUITE("max_pool", max_pool_suite);

}  // namespace
