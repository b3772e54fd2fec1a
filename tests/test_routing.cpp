// The layers' routing table (hierpar/routing.h): which convolution calls hierpar::nn's layers run on hierpar's
// kernels and which on cuDNN's, for the DCGAN's layers and around its edges; and, on a GPU, that a layer's call
// dispatches what the table says (a RecordFunction callback lists the operators a call dispatches).
#include "conv_testing.h"
#include "testing.h"

#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"
#include "hierpar/routing.h"
#include "hierpar/switches.h"


#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/conv_transpose2d.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using hierpar::ops::ConvCall;

// A CUDA call with a square kernel, stride and padding on a square input.
ConvCall cuda_call(int64_t cin, int64_t cout, int64_t kernel, int64_t stride, int64_t padding, int64_t size,
                   at::ScalarType dtype = at::kFloat, bool channels_last = false) {
  ConvCall c;
  c.cuda = true;
  c.dtype = dtype;
  c.channels_last = channels_last;
  c.tf32 = true;
  c.in_channels = cin;
  c.out_channels = cout;
  c.input_h = c.input_w = size;
  c.kernel_h = c.kernel_w = kernel;
  c.stride_h = c.stride_w = stride;
  c.padding_h = c.padding_w = padding;
  return c;
}

TEST(Routing, ConvTranspose2dTableForTheDcganGenerator) {
  using hierpar::ops::hierpar_wins_conv_transpose2d;
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    EXPECT_TRUE(hierpar_wins_conv_transpose2d(cuda_call(100, 512, 4, 1, 0, 1, dtype))) << "projection";
    EXPECT_FALSE(hierpar_wins_conv_transpose2d(cuda_call(512, 256, 4, 2, 1, 4, dtype))) << "middle layer";
    EXPECT_FALSE(hierpar_wins_conv_transpose2d(cuda_call(128, 64, 4, 2, 1, 16, dtype))) << "middle layer";
    EXPECT_TRUE(hierpar_wins_conv_transpose2d(cuda_call(64, 3, 4, 2, 1, 32, dtype, true))) << "RGB output layer";
    EXPECT_TRUE(hierpar_wins_conv_transpose2d(cuda_call(64, 4, 4, 2, 1, 32, dtype, true))) << "C_out 4";
    EXPECT_FALSE(hierpar_wins_conv_transpose2d(cuda_call(64, 5, 4, 2, 1, 32, dtype, true))) << "C_out 5";
  }
  // The output layer in float32: as TF32 tensor-core passes (channels_last, C_in % 16 == 0), else cuDNN's; 16 bits
  // (or autocast) in any layout.
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(cuda_call(64, 3, 4, 2, 1, 32, at::kFloat, false))) << "float32 NCHW";
  ConvCall large_nchw = cuda_call(64, 3, 4, 2, 1, 32, at::kFloat, false);
  large_nchw.batch = 1023;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(large_nchw)) << "float32 NCHW eagerly below batch 1024";
  large_nchw.batch = 1024;
  EXPECT_TRUE(hierpar_wins_conv_transpose2d(large_nchw)) << "float32 NCHW eagerly from batch 1024";
  ConvCall captured_nchw = cuda_call(64, 3, 4, 2, 1, 32, at::kFloat, false);
  captured_nchw.captured = true;
  captured_nchw.batch = 255;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(captured_nchw)) << "float32 NCHW captured below batch 256";
  captured_nchw.batch = 256;
  EXPECT_TRUE(hierpar_wins_conv_transpose2d(captured_nchw)) << "float32 NCHW captured from batch 256";
  large_nchw.tf32 = false;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(large_nchw)) << "float32 NCHW without TF32";
  EXPECT_TRUE(hierpar_wins_conv_transpose2d(cuda_call(64, 3, 4, 2, 1, 32, at::kBFloat16, false))) << "bf16 NCHW";
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(cuda_call(40, 3, 4, 2, 1, 32, at::kFloat, true))) << "C_in % 16 != 0";
  ConvCall true_fp32 = cuda_call(64, 3, 4, 2, 1, 32, at::kFloat, true);
  true_fp32.tf32 = false;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(true_fp32)) << "float32 without TF32";
  true_fp32.autocast = true;
  EXPECT_TRUE(hierpar_wins_conv_transpose2d(true_fp32)) << "under autocast the call runs in 16 bits";
  ConvCall dilated = cuda_call(64, 3, 4, 2, 1, 32);
  dilated.dilation_w = 2;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(dilated));
  ConvCall padded_out = cuda_call(100, 512, 4, 1, 0, 1);
  padded_out.output_padding_h = 1;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(padded_out));
  ConvCall grouped = cuda_call(64, 4, 4, 2, 1, 32);
  grouped.groups = 2;
  EXPECT_FALSE(hierpar_wins_conv_transpose2d(grouped));
  ConvCall on_cpu = cuda_call(512, 256, 4, 2, 1, 4);
  on_cpu.cuda = false;
  EXPECT_TRUE(hierpar_wins_conv_transpose2d(on_cpu)) << "the CPU op chooses for itself";
}

TEST(Routing, Conv2dTableForTheDcganDiscriminator) {
  using hierpar::ops::hierpar_wins_conv2d;
  // The RGB input layer: 16-bit (or autocast) always; float32 only as TF32 tensor-core passes.
  EXPECT_TRUE(hierpar_wins_conv2d(cuda_call(3, 64, 4, 2, 1, 64, at::kBFloat16)));
  EXPECT_TRUE(hierpar_wins_conv2d(cuda_call(3, 64, 4, 2, 1, 64, at::kHalf, true)));
  EXPECT_TRUE(hierpar_wins_conv2d(cuda_call(3, 64, 4, 2, 1, 64, at::kFloat, /*channels_last=*/true)));
  EXPECT_FALSE(hierpar_wins_conv2d(cuda_call(3, 64, 4, 2, 1, 64, at::kFloat, /*channels_last=*/false)));
  ConvCall no_tf32 = cuda_call(3, 64, 4, 2, 1, 64, at::kFloat, true);
  no_tf32.tf32 = false;
  EXPECT_FALSE(hierpar_wins_conv2d(no_tf32));
  no_tf32.autocast = true;
  EXPECT_TRUE(hierpar_wins_conv2d(no_tf32)) << "under autocast the call runs in 16 bits";
  EXPECT_FALSE(hierpar_wins_conv2d(cuda_call(3, 8, 4, 2, 1, 64, at::kFloat, true))) << "C_out % 16 != 0 in TF32";
  // The wider layers: cuDNN's.
  EXPECT_FALSE(hierpar_wins_conv2d(cuda_call(64, 128, 4, 2, 1, 32, at::kBFloat16, true)));
  EXPECT_FALSE(hierpar_wins_conv2d(cuda_call(256, 512, 4, 2, 1, 8)));
  // The last layer: a window over the whole 4x4 map; the same layer on a larger map is an ordinary convolution.
  EXPECT_TRUE(hierpar_wins_conv2d(cuda_call(512, 1, 4, 1, 0, 4)));
  EXPECT_TRUE(hierpar_wins_conv2d(cuda_call(512, 1, 4, 1, 0, 4, at::kBFloat16, true)));
  EXPECT_FALSE(hierpar_wins_conv2d(cuda_call(512, 1, 4, 1, 0, 5)));
  ConvCall on_cpu = cuda_call(256, 512, 4, 2, 1, 8);
  on_cpu.cuda = false;
  EXPECT_TRUE(hierpar_wins_conv2d(on_cpu));
}

// On the CPU a layer always calls hierpar's op (which picks ATen or its reference kernels itself).
TEST(Routing, CpuCallsTakeHierparsOp) {
  const auto x = hierpar::testing::random_tensor({2, 64, 8, 8}, torch::TensorOptions().dtype(torch::kFloat));
  const auto w = hierpar::testing::random_tensor({64, 32, 4, 4}, torch::TensorOptions().dtype(torch::kFloat));
  EXPECT_TRUE(hierpar::ops::conv_transpose2d_on_hierpar(x, w, {2, 2}, {1, 1}, {0, 0}, 1, {1, 1}));
  EXPECT_TRUE(hierpar::ops::conv2d_on_hierpar(x, w, {2, 2}, {1, 1}, {1, 1}, 1));
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// A generator's middle layer on the GPU runs cuDNN's transposed convolution, its output layer hierpar's; with
// Switch::layer_routing off both run hierpar's; each agrees with ATen.
TEST(Routing, CudaLayersDispatchWhatTheTableSays) {
  HIERPAR_REQUIRE_CUDA();
  // The float32 rows below assume TF32 allowed (ATen's default), whatever a test before this one in the process set.
  const hierpar::testing::Tf32ForConvolutions tf32_allowed(true);
  const auto opts = torch::TensorOptions(torch::kCUDA).dtype(torch::kFloat);
  hierpar::nn::ConvTranspose2d middle(torch::nn::ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1).bias(false));
  hierpar::nn::ConvTranspose2d output(torch::nn::ConvTranspose2dOptions(32, 3, 4).stride(2).padding(1).bias(false));
  middle->to(torch::kCUDA);
  output->to(torch::kCUDA);
  const auto x = hierpar::testing::random_tensor({2, 64, 8, 8}, opts);
  // channels_last: the float32 output layer takes hierpar's kernels as TF32 tensor-core passes (in NCHW, cuDNN's).
  const auto h = hierpar::testing::random_tensor({2, 32, 16, 16}, opts).contiguous(at::MemoryFormat::ChannelsLast);
  for (const bool routing : {true, false}) {
    hierpar::SwitchScope scope(hierpar::Switch::layer_routing, routing);
    torch::Tensor y_middle, y_output;
    const auto middle_ops = hierpar::testing::dispatched_operators([&] { y_middle = middle->forward(x); });
    const auto output_ops = hierpar::testing::dispatched_operators([&] { y_output = output->forward(h); });
    EXPECT_EQ(has(middle_ops, "hierpar::conv_transpose2d"), !routing) << "routing " << routing;
    // The cuDNN route calls at::convolution directly (at::conv_transpose2d's own callee: one dispatch fewer).
    if (routing) EXPECT_TRUE(has(middle_ops, "aten::convolution"));
    EXPECT_TRUE(has(output_ops, "hierpar::conv_transpose2d")) << "routing " << routing;
    const auto nchw_ops = hierpar::testing::dispatched_operators([&] { output->forward(h.contiguous()); });
    EXPECT_EQ(has(nchw_ops, "hierpar::conv_transpose2d"), !routing) << "float32 NCHW output layer, routing " << routing;
    // TF32 may run on either side (cuDNN's default), so TF32's tolerance.
    const hierpar::testing::Tolerance tf32{5e-3, 5e-3};
    hierpar::testing::expect_close(y_middle, at::conv_transpose2d(x, middle->weight, {}, 2, 1), tf32, "middle layer");
    hierpar::testing::expect_close(y_output, at::conv_transpose2d(h, output->weight, {}, 2, 1), tf32, "output layer");
  }
}

// The float32 NCHW output layer at batch 256: cuDNN's eagerly, hierpar's in a CUDA graph's capture (its replay pays
// GPU time alone); the replay's output agrees with the eager call's.
TEST(Routing, CapturedNchwOutputLayerTakesHierparsKernels) {
  HIERPAR_REQUIRE_CUDA();
  const hierpar::testing::Tf32ForConvolutions tf32_allowed(true);
  hierpar::SwitchScope routing(hierpar::Switch::layer_routing, true);
  const auto opts = torch::TensorOptions(torch::kCUDA).dtype(torch::kFloat);
  hierpar::nn::ConvTranspose2d output(torch::nn::ConvTranspose2dOptions(64, 3, 4).stride(2).padding(1).bias(false));
  output->to(torch::kCUDA);
  const auto h = hierpar::testing::random_tensor({256, 64, 16, 16}, opts);
  torch::NoGradGuard no_grad;
  torch::Tensor eager;
  const auto eager_ops = hierpar::testing::dispatched_operators([&] { eager = output->forward(h); });
  EXPECT_FALSE(has(eager_ops, "hierpar::conv_transpose2d")) << "eager call at batch 256";

  const c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
  c10::cuda::getCurrentCUDAStream().synchronize();  // the input and weights are ready before the capture reads them
  at::cuda::CUDAGraph graph;
  torch::Tensor captured;
  std::vector<std::string> captured_ops;
  {
    const c10::cuda::CUDAStreamGuard on_capture_stream(capture_stream);
    graph.capture_begin();
    captured_ops = hierpar::testing::dispatched_operators([&] { captured = output->forward(h); });
    graph.capture_end();
  }
  EXPECT_TRUE(has(captured_ops, "hierpar::conv_transpose2d")) << "captured call at batch 256";
  captured.fill_(std::numeric_limits<float>::quiet_NaN());
  graph.replay();
  hierpar::testing::expect_close(captured, eager, hierpar::testing::Tolerance{5e-3, 5e-3}, "replayed vs eager");
}

}  // namespace
