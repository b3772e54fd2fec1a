// Suite "user_loop": a user's own LibTorch C++ DCGAN training loop, written the way pytorch/examples' cpp/dcgan writes
// it, with stock LibTorch and with what hierpar offers that user, on one GPU. It measures what a user who keeps their
// loop gets from hierpar for one line of code (hierpar::nn::convert), one more (hierpar::optim::Adam) and a CUDA graph
// (hierpar::strategy::GraphedStep), each against stock's best counterpart in the same process.
//
// The loop (UserLoop::body), as cpp/dcgan: torch::nn::Sequential generator and discriminator (the seed's DCGAN at
// 64x64x3, nz 100; sigmoid at D's end), torch::optim::Adam(2e-4, betas 0.5/0.999) for each, and per step:
//   D.zero_grad; real_labels = empty(batch).uniform_(0.8, 1.0) (cpp/dcgan's label smoothing);
//   bce(D(real), real_labels).backward(); noise = randn(batch, 100, 1, 1); fake = G(noise);
//   bce(D(fake.detach()), zeros).backward(); D.step; G.zero_grad; fake_labels.fill_(1);
//   bce(D(fake), fake_labels).backward(); G.step
// with torch::binary_cross_entropy. Module::zero_grad sets gradients to none (LibTorch's default); G's backward also
// computes D's weight gradients, which D's next zero_grad discards, as in cpp/dcgan. Real images: random data in
// [-1, 1] on the GPU, a pool of kPoolBatches batches; each step first copies the next one into a static buffer the
// body reads (the copy is part of the timed step, as a loader's copy would be).
//
// Precision "fp32": torch's defaults (no autocast, NCHW). cuDNN may use TF32 for the convolutions, as PyTorch's default
// (allow_tf32 for cuDNN on) allows; extra.cudnn_tf32 records the setting. hierpar-bench turns cuDNN's benchmark mode on
// for every suite (main.cpp: stock at its strongest); extra.cudnn_benchmark records it.
//
// Modes (config.mode); every mode has a stock row and a hierpar row of identical config (shared/BENCH_FORMAT.md):
//  - "eager": the loop as written. stock: torch::nn layers + torch::optim::Adam; hierpar: the same models after
//    hierpar::nn::convert (hierpar's layers on the same tensors, BatchNorm2d + ReLU/LeakyReLU fused into
//    BatchNormAct2d), still torch::optim::Adam: what the conversion alone gives. The conversion must leave no layer
//    stock (ConversionReport::left empty); extra.layers_converted and extra.pairs_fused say what it did.
//  - "converted_fused_adam": hierpar: converted layers + hierpar::optim::Adam (multi-tensor, on-device step), eager.
//    Its stock row is stock's eager loop again (torch::nn + torch::optim::Adam, stock's own drop-in loop), built and
//    timed anew in this pairing, so that each hierpar row is paired with a stock row timed beside it.
//  - "captured": the body as one CUDA graph through hierpar::strategy::GraphedStep (the static buffer is filled from
//    the pool before each replay, outside the body; labels and noise are drawn inside it). torch::optim::Adam keeps
//    its step count on the host and cannot be captured, so stock uses ATen's fused Adam (what
//    torch.optim.Adam(fused=True) runs) through hierpar::strategy::FusedAdam(..., AdamKernel::aten) on torch::nn
//    layers; hierpar: converted layers + hierpar::optim::Adam. extra.kernels_per_step: the graph's kernel nodes.
//  - "trainer_captured": the dcgan_step suite's graph rows as it builds them (dcgan_steps.h) on the same batch, for
//    reference beside the user's loop: stock = StockDcganStep (torch::nn layers, ATen's fused Adam) captured by
//    GraphedStep; hierpar = TrainerStep, hierpar::strategy::AdversarialTrainer on hierpar's layers capturing its own
//    step. Both use hierpar::models' DCGAN: the user's network (with DCGAN's N(0, 0.02) initialisation) without the
//    final Sigmoid, so D gives logits and the losses are binary_cross_entropy_with_logits; their labels are constant
//    ones/zeros (no label smoothing), D's loss is one backward of (real + fake), G's backward leaves D's weight
//    gradients alone, and they read one static batch in place (no pool copy). Neither class shows its losses, so
//    these rows' losses are not checked (extra.losses_checked false).
//
// Timing: per pair, both loops are built (same seed) and warmed up (kWarmup steps; a captured loop's first kWarmup
// calls run eagerly inside GraphedStep, the next captures), then two rounds, each timing stock's loop then hierpar's:
// steps_timed steps, each between two CUDA events on the current stream; a sample is one step, in microseconds. Each
// row reports the round with the lower median (a shared host only slows a round down); extra.round_medians_us holds
// both rounds'. After the timing, each row's last D and G losses are read once on the host and must be finite.
// --skip TEXT leaves out the pairs whose label ("user_loop batch 64 eager") contains TEXT.
#include "bench.h"
#include "dcgan_steps.h"

#include "hierpar/optim.h"
#include "hierpar/strategy/fused_adam.h"
#include "hierpar/strategy/graphed_step.h"

#include "hierpar/nn/convert.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/nn.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace hierpar::bench;
namespace hs = hierpar::strategy;
namespace nn = torch::nn;

constexpr int64_t kNoiseSize = 100;
constexpr int kWarmup = 10;      // eager steps before timing (and before a capture)
constexpr int kPoolBatches = 4;  // distinct random batches the static input buffer is filled from, in turn

nn::Sequential make_generator() {
  return nn::Sequential(
      nn::ConvTranspose2d(nn::ConvTranspose2dOptions(kNoiseSize, 256, 4).stride(1).padding(0).bias(false)),
      nn::BatchNorm2d(256), nn::ReLU(nn::ReLUOptions(true)),
      nn::ConvTranspose2d(nn::ConvTranspose2dOptions(256, 128, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(128), nn::ReLU(nn::ReLUOptions(true)),
      nn::ConvTranspose2d(nn::ConvTranspose2dOptions(128, 64, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(64), nn::ReLU(nn::ReLUOptions(true)),
      nn::ConvTranspose2d(nn::ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(32), nn::ReLU(nn::ReLUOptions(true)),
      nn::ConvTranspose2d(nn::ConvTranspose2dOptions(32, 3, 4).stride(2).padding(1).bias(false)), nn::Tanh());
}

nn::Sequential make_discriminator() {
  const auto leaky = [] { return nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2).inplace(true)); };
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(3, 32, 4).stride(2).padding(1).bias(false)), leaky(),
      nn::Conv2d(nn::Conv2dOptions(32, 64, 4).stride(2).padding(1).bias(false)), nn::BatchNorm2d(64), leaky(),
      nn::Conv2d(nn::Conv2dOptions(64, 128, 4).stride(2).padding(1).bias(false)), nn::BatchNorm2d(128), leaky(),
      nn::Conv2d(nn::Conv2dOptions(128, 256, 4).stride(2).padding(1).bias(false)), nn::BatchNorm2d(256), leaky(),
      nn::Conv2d(nn::Conv2dOptions(256, 1, 4).stride(1).padding(0).bias(false)), nn::Sigmoid());
}

// The user's one line: hierpar's layers in place of the model's, on the same tensors. Returns (layers converted,
// batch norm + activation pairs fused); every layer must have been converted (none left), or the hierpar row would
// time stock layers.
std::pair<int64_t, int64_t> convert_layers(nn::Sequential& model) {
  const hierpar::nn::ConversionReport report = hierpar::nn::convert(model);
  TORCH_CHECK(report.left.empty() && !report.converted.empty(),
              "user_loop: hierpar::nn::convert left layers of the model stock:\n", report);
  return {static_cast<int64_t>(report.converted.size()), static_cast<int64_t>(report.fused.size())};
}

enum class AdamKind { torch, aten_fused, hierpar };

const char* name_of(AdamKind kind) {
  switch (kind) {
    case AdamKind::torch: return "torch::optim::Adam";
    case AdamKind::aten_fused: return "hierpar::strategy::FusedAdam(AdamKernel::aten)";
    case AdamKind::hierpar: return "hierpar::optim::Adam";
  }
  return "?";
}

std::unique_ptr<torch::optim::Optimizer> make_adam(const std::vector<torch::Tensor>& params, AdamKind kind) {
  const auto options = torch::optim::AdamOptions(2e-4).betas(std::make_tuple(0.5, 0.999));
  switch (kind) {
    case AdamKind::torch: return std::make_unique<torch::optim::Adam>(params, options);
    case AdamKind::aten_fused: return std::make_unique<hs::FusedAdam>(params, options, hs::AdamKernel::aten);
    case AdamKind::hierpar: return std::make_unique<hierpar::optim::Adam>(params, options);
  }
  TORCH_CHECK(false, "user_loop: unknown Adam kind");
}

c10::Device current_cuda_device() { return c10::Device(c10::kCUDA, c10::cuda::current_device()); }

// A training loop as the suite times it: step() is one step (enqueue-only once warmed up).
class Loop {
 public:
  virtual ~Loop() = default;
  virtual void step() = 0;
  // Kernel nodes of the captured graph(s); -1 for an eager loop.
  virtual int64_t kernels_per_step() const { return -1; }
  // The last step's D and G losses, read on the host (a sync); nullopt where the loop keeps them to itself.
  virtual std::optional<std::pair<double, double>> losses() const { return std::nullopt; }
  // Adds what the loop is made of to a record's extra fields.
  virtual void describe(Config& /*extra*/) const {}
};

// The user's loop: cpp/dcgan's body on the suite's models, eager or captured by GraphedStep.
class UserLoop : public Loop {
 public:
  UserLoop(int64_t batch, bool converted, AdamKind adam, bool captured)
      : batch_(batch), adam_(adam), generator_(make_generator()), discriminator_(make_discriminator()) {
    const auto cuda = torch::TensorOptions().device(current_cuda_device());
    generator_->to(cuda.device());
    discriminator_->to(cuda.device());
    if (converted) {
      const auto g = convert_layers(generator_), d = convert_layers(discriminator_);
      layers_converted_ = g.first + d.first;
      pairs_fused_ = g.second + d.second;
    }
    generator_optimizer_ = make_adam(generator_->parameters(), adam);
    discriminator_optimizer_ = make_adam(discriminator_->parameters(), adam);
    for (int i = 0; i < kPoolBatches; ++i) pool_.push_back(torch::rand({batch, 3, 64, 64}, cuda) * 2 - 1);
    real_images_ = pool_[0].clone();
    if (captured) {
      hs::GraphedStepOptions options;
      options.warm_up_steps = kWarmup;
      graphed_ = std::make_unique<hs::GraphedStep>([this] { body(); }, cuda.device(), options);
    }
  }

  void step() override {
    real_images_.copy_(pool_[next_batch_++ % pool_.size()]);  // the loader's copy into the static buffer
    if (graphed_) {
      (*graphed_)();
    } else {
      body();
    }
  }

  int64_t kernels_per_step() const override { return graphed_ ? graphed_->kernel_nodes() : -1; }

  std::optional<std::pair<double, double>> losses() const override {
    return std::pair{d_loss_.item<double>(), g_loss_.item<double>()};
  }

  void describe(Config& extra) const override {
    extra.set("optimizer", name_of(adam_)).set("loss", "binary_cross_entropy");
    extra.set("layers_converted", layers_converted_).set("pairs_fused", pairs_fused_);
  }

 private:
  void body() {
    const auto cuda = real_images_.options();
    // Train the discriminator with real images.
    discriminator_->zero_grad();
    torch::Tensor real_labels = torch::empty({batch_}, cuda).uniform_(0.8, 1.0);
    torch::Tensor real_output = discriminator_->forward(real_images_).reshape(real_labels.sizes());
    torch::Tensor d_loss_real = torch::binary_cross_entropy(real_output, real_labels);
    d_loss_real.backward();
    // Train the discriminator with fake images.
    torch::Tensor noise = torch::randn({batch_, kNoiseSize, 1, 1}, cuda);
    torch::Tensor fake_images = generator_->forward(noise);
    torch::Tensor fake_labels = torch::zeros({batch_}, cuda);
    torch::Tensor fake_output = discriminator_->forward(fake_images.detach()).reshape(fake_labels.sizes());
    torch::Tensor d_loss_fake = torch::binary_cross_entropy(fake_output, fake_labels);
    d_loss_fake.backward();
    torch::Tensor d_loss = d_loss_real + d_loss_fake;
    discriminator_optimizer_->step();
    // Train the generator.
    generator_->zero_grad();
    fake_labels.fill_(1);
    fake_output = discriminator_->forward(fake_images).reshape(fake_labels.sizes());
    torch::Tensor g_loss = torch::binary_cross_entropy(fake_output, fake_labels);
    g_loss.backward();
    generator_optimizer_->step();
    d_loss_ = d_loss.detach();  // kept without their autograd graphs, for the check after timing
    g_loss_ = g_loss.detach();
  }

  int64_t batch_;
  AdamKind adam_;
  int64_t layers_converted_ = 0, pairs_fused_ = 0;
  nn::Sequential generator_, discriminator_;
  std::unique_ptr<torch::optim::Optimizer> generator_optimizer_, discriminator_optimizer_;
  std::vector<torch::Tensor> pool_;
  torch::Tensor real_images_, d_loss_, g_loss_;
  size_t next_batch_ = 0;
  std::unique_ptr<hs::GraphedStep> graphed_;
};

// One of dcgan_steps.h's steps (the dcgan_step suite's rows) as a Loop; one that does not capture itself is captured
// by GraphedStep.
class TrainingStepLoop : public Loop {
 public:
  TrainingStepLoop(std::unique_ptr<TrainingStep> step, const char* optimizer)
      : step_(std::move(step)), optimizer_(optimizer) {
    if (step_->captures_itself()) return;
    hs::GraphedStepOptions options;
    options.warm_up_steps = kWarmup;
    graphed_ = std::make_unique<hs::GraphedStep>([s = step_.get()] { s->run(); }, current_cuda_device(), options);
  }
  void step() override {
    if (graphed_) {
      (*graphed_)();
    } else {
      step_->run();
    }
  }
  int64_t kernels_per_step() const override {
    return graphed_ ? graphed_->kernel_nodes() : step_->graph_kernel_nodes();
  }
  void describe(Config& extra) const override {
    extra.set("optimizer", optimizer_).set("loss", "binary_cross_entropy_with_logits");
  }

 private:
  std::unique_ptr<TrainingStep> step_;
  const char* optimizer_;
  std::unique_ptr<hs::GraphedStep> graphed_;
};

bool captured_mode(const std::string& mode) { return mode == "captured" || mode == "trainer_captured"; }

// The loop of `impl` ("stock" or "hierpar") in `mode`, at `batch` (see the file comment).
std::unique_ptr<Loop> make_loop(const std::string& mode, const std::string& impl, int64_t batch) {
  const bool hierpar = impl == "hierpar";
  if (mode == "eager") return std::make_unique<UserLoop>(batch, hierpar, AdamKind::torch, false);
  if (mode == "converted_fused_adam") {
    return std::make_unique<UserLoop>(batch, hierpar, hierpar ? AdamKind::hierpar : AdamKind::torch, false);
  }
  if (mode == "captured") {
    return std::make_unique<UserLoop>(batch, hierpar, hierpar ? AdamKind::hierpar : AdamKind::aten_fused, true);
  }
  TORCH_CHECK(mode == "trainer_captured", "user_loop: unknown mode ", mode);
  if (hierpar) {
    return std::make_unique<TrainingStepLoop>(std::make_unique<TrainerStep>(batch, false, false, /*graphs=*/true),
                                              "AdversarialTrainer's FusedAdam (hierpar kernel)");
  }
  return std::make_unique<TrainingStepLoop>(std::make_unique<StockDcganStep>(batch, false, false),
                                            name_of(AdamKind::aten_fused));
}

// One impl's loop of a pair and its two rounds' timings.
struct Side {
  std::string impl;
  std::unique_ptr<Loop> loop;
  std::vector<Timing> rounds;
};

// One side's best round (the lower median) and its extra fields; throws when its losses are not finite.
std::pair<Timing, Config> result_of(const std::string& mode, int64_t batch, int steps, const Side& side) {
  const auto best = std::min_element(side.rounds.begin(), side.rounds.end(),
                                     [](const Timing& a, const Timing& b) { return a.median_us < b.median_us; });
  std::vector<double> round_medians;
  for (const Timing& t : side.rounds) round_medians.push_back(t.median_us);
  Config extra;
  extra.set("ms_per_step", best->median_us / 1e3)
      .set("images_per_s", batch * 1e6 / best->median_us)
      .set("round_medians_us", round_medians)
      .set("kept_round", static_cast<int64_t>(best - side.rounds.begin()))
      .set("steps_timed", static_cast<int64_t>(steps))
      .set("warmup_steps", static_cast<int64_t>(kWarmup));
  if (captured_mode(mode)) extra.set("kernels_per_step", side.loop->kernels_per_step());
  const auto losses = side.loop->losses();  // read once on the host, after the timing
  extra.set("losses_checked", losses.has_value());
  if (losses) {
    TORCH_CHECK(std::isfinite(losses->first) && std::isfinite(losses->second), "user_loop: ", side.impl, " ", mode,
                " batch ", batch, ": losses are not finite after the timed steps (D ", losses->first, ", G ",
                losses->second, ")");
    extra.set("d_loss", losses->first).set("g_loss", losses->second);
  }
  side.loop->describe(extra);
  extra.set("cudnn_benchmark", at::globalContext().benchmarkCuDNN())
      .set("cudnn_tf32", at::globalContext().allowTF32CuDNN(at::Float32Op::CONV));
  return {*best, extra};
}

void release_memory() {
  at::cuda::getCurrentCUDAStream().synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
}

// Stock's and hierpar's rows of one (mode, batch): both loops built from the same seed and warmed up, then two
// rounds of stock's steps then hierpar's, each step timed between CUDA events.
void measure_pair(Report& report, const std::string& mode, int64_t batch, const Options& options) {
  const int steps = options.quick ? 30 : batch <= 64 ? 200 : 100;
  std::vector<Side> sides;
  for (const char* impl : {"stock", "hierpar"}) {
    torch::manual_seed(0);
    sides.push_back({impl, make_loop(mode, impl, batch), {}});
  }
  for (Side& side : sides) {
    // kWarmup eager steps; a captured loop then captures and replays a few times (the first replay uploads).
    for (int i = 0; i < kWarmup + 5; ++i) side.loop->step();
    at::cuda::getCurrentCUDAStream().synchronize();
    TORCH_CHECK(!captured_mode(mode) || side.loop->kernels_per_step() > 0, "user_loop: ", side.impl, " ", mode,
                " batch ", batch, ": the step was not captured during the warm-up");
  }
  for (int round = 0; round < 2; ++round) {
    for (Side& side : sides) {
      Loop& loop = *side.loop;
      side.rounds.push_back(time_cuda([&loop] { loop.step(); }, /*warmup=*/0, steps));
    }
  }
  Config config;
  config.set("program", "cpp_dcgan").set("batch", batch).set("mode", mode).set("precision", "fp32");
  // Both sides checked before either is reported: a hierpar row never goes out without its stock row.
  std::vector<std::pair<Timing, Config>> results;
  for (const Side& side : sides) results.push_back(result_of(mode, batch, steps, side));
  for (size_t i = 0; i < sides.size(); ++i) {
    report.add("user_loop", sides[i].impl, config, results[i].first, results[i].second);
  }
  sides.clear();
  release_memory();
}

// After a failed pair: its memory back, unless the device cannot even do that (a sticky error: the next pair says so).
void release_memory_after_failure() {
  try {
    release_memory();
  } catch (const std::exception&) {
  }
}

// measure_pair, or why it failed (one line; empty when it did not): a failed pair (a capture refused, out of
// memory) does not stop the others.
std::string try_pair(Report& report, const std::string& mode, int64_t batch, const Options& options) {
  try {
    measure_pair(report, mode, batch, options);
    return {};
  } catch (const c10::Error& e) {
    release_memory_after_failure();
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    release_memory_after_failure();
    return e.what();
  }
}

void user_loop_suite(Report& report, const Options& options) {
  std::vector<std::string> skipped, failed;
  for (int64_t batch : options.any_batches({64, 256})) {
    for (const std::string mode : {"eager", "converted_fused_adam", "captured", "trainer_captured"}) {
      const std::string label = "user_loop batch " + std::to_string(batch) + " " + mode;
      if (options.skips(label, skipped)) continue;
      const std::string error = try_pair(report, mode, batch, options);
      if (error.empty()) continue;
      failed.push_back(label + ": " + error.substr(0, error.find('\n')));
      std::cerr << "user_loop: " << failed.back() << "\n";
    }
  }
  for (const std::string& row : skipped) std::cout << "  skipped " << row << "\n";
  TORCH_CHECK(failed.empty(), failed.size(), " pair(s) failed, the first: ", failed.empty() ? "" : failed.front());
}

HIERPAR_BENCH_SUITE("user_loop", user_loop_suite);

}  // namespace
