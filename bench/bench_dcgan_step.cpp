// Suite "dcgan_step": one whole training step of the seed's DCGAN (64x64x3 images, nz 100) on one GPU, stock
// torch::nn layers against hierpar's (LayerSet), eager and as one CUDA graph, in TF32 (NCHW and channels_last) and
// in bf16 autocast with channels_last, at batch 64..4096; and the seed CNN's step (bench "cnn_step", eager and as
// one CUDA graph).
//
// The step is the anchor's recipe (shared/anchors/dcgan_torch.py):
//   z = randn; D.zero_grad; e_real = BCE(D(real), 1); fake = G(z); e_fake = BCE(D(fake.detach()), 0);
//   (e_real + e_fake).backward(); D.step; G.zero_grad; e_g = BCE(D(fake), 1); e_g.backward(); G.step
// with BCE-with-logits, Adam(2e-4, 0.5, 0.999). The stock rows write it out with torch::nn layers on one stream
// (StockDcganStep); hierpar's rows run hierpar::strategy::AdversarialTrainer, the step its users get (hierpar's
// layers, its fused Adam kernel hierpar::fused_adam_, G's forward and D's pass over the fakes on a second stream,
// its own graph capture). Two choices differ from the anchor's code but not its results, and both sides make
// them: G's backward does not compute D's weight gradients (the anchor's does, and D's next zero_grad discards
// them), and zero_grad sets gradients to none (no zero fill, no accumulation add). Stock uses
// hierpar::strategy::FusedAdam (capturable) with ATen's fused Adam kernel (torch.optim.Adam(fused=True)'s).
//
// Stock at its strongest: cuDNN benchmark mode (main.cpp), TF32 for convolutions and matmuls, channels_last
// rows (bf16, and TF32 beside NCHW), CUDA graph rows too. The real batch is a static device tensor (data loading is not timed).
//
// Eager rows are timed in paired samples of stock and hierpar taken in turn (the host's speed drifts): each row's
// median sample, and extra.paired_ratio, the median of stock / hierpar over the pairs (measure_pair).
// extra: ms_per_step, images_per_s, kernels_per_step and gpu_busy_us_per_step (kineto/CUPTI profile of 3
// steps), layout_conversions_per_step (cuDNN NCHW<->NHWC kernels in that profile), graph_kernel_nodes
// (kernel nodes of the captured graph, cudaGraphGetNodes: a cross-check of the profile for graph rows),
// peak_mem_mb (caching allocator's peak allocated bytes over the timed steps, less what was allocated before
// the row's models were built; the peak is reset after warm-up so cuDNN's benchmark search is not counted; a
// graph's private pool is allocated memory and counts).
// HIERPAR_STEP_PROFILE=<file> writes each row's kernels by GPU time there, HIERPAR_STEP_TRACE=<dir> each row's
// profiled steps as a Chrome trace; HIERPAR_BENCH_OVERLAP=0 runs hierpar's
// step on one stream (options.overlap_passes off), HIERPAR_BENCH_JOINT_FROM=N joins D's captured backward branches
// from N images (options.joint_discriminator_backward_batch), HIERPAR_BENCH_EAGER_OVERLAP_FROM=N runs the eager
// steps on two streams from N images (options.eager_overlap_batch). A chart of ms/step (stock vs
// hierpar, eager and graph, per batch and precision) goes beside the JSON as <gpu>-dcgan_step.png when the
// examples (their PNG writer) are built.
#include "bench.h"
#include "dcgan_steps.h"

#include "hierpar/models/cnn.h"
#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/captured_step.h"
#include "hierpar/strategy/fused_adam.h"
#include "hierpar/strategy/precision.h"

#ifdef HIERPAR_BENCH_CHARTS
#include "common/images.h"
#endif

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;
using hierpar::LayerSet;
using hierpar::strategy::CapturedStep;
using hierpar::strategy::AdamKernel;
using hierpar::strategy::FusedAdam;

const char* name_of(LayerSet layers) { return layers == LayerSet::stock ? "stock" : "hierpar"; }

class CnnStep : public TrainingStep {
 public:
  CnnStep(LayerSet layers, int64_t batch) : model_(layers) {
    model_->to(at::kCUDA);
    optimizer_ = std::make_unique<FusedAdam>(model_->parameters(), torch::optim::AdamOptions(1e-3),
                                             layers == LayerSet::stock ? AdamKernel::aten : AdamKernel::hierpar);
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    images_ = at::rand({batch, 1, 28, 28}, cuda);
    labels_ = at::randint(0, 10, {batch}, cuda.dtype(at::kLong));
  }
  void run() override {
    optimizer_->zero_grad();
    const auto loss = at::cross_entropy_loss(model_->forward(images_), labels_);
    loss.backward();
    loss_ = loss.detach();
    optimizer_->step();
  }

 private:
  hierpar::models::SeedCNN model_;
  std::unique_ptr<FusedAdam> optimizer_;
  at::Tensor images_, labels_, loss_;
};

// The caching allocator's allocated bytes (current or peak), in MiB.
double allocated_mb(bool peak) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
  const auto& stat = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return (peak ? stat.peak : stat.current) / 1048576.0;
}

// One side stream for every row's warm-up and capture, so cuBLAS's per-stream workspaces are allocated once,
// before the first row (warm_side_stream), not charged to whichever row first used a new stream.
c10::cuda::CUDAStream side_stream() {
  static const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  return stream;
}

struct Row {
  std::string bench, impl, precision, layout, graphs;
  int64_t batch;
  double ms, images_per_s, kernels, busy_us, conversions, peak;
  int64_t graph_nodes;
  double paired_ratio = 0;  // eager rows: the median over paired samples of stock's ms / this row's
};

// One row's measurement, reported by record().
struct Measured {
  Row row;
  Config config, extra;
  Timing timing;
  Profile profile;
};

// Warms `step` up, optionally captures it, times `steps_per_sample` steps per CUDA-event sample and profiles it.
Measured measure(const std::string& bench, LayerSet layers, int64_t batch, bool bf16, bool channels_last, bool graphs,
                 TrainingStep& step, double allocated_before_mb, const Options& options) {
  const int steps_per_sample = batch <= 256 ? 50 : batch <= 1024 ? 20 : 10;
  const int samples = options.quick ? 3 : 5;
  // Warm-up on a side stream (cuDNN's benchmark search, lazy initialisation, the optimiser's first steps),
  // as torch.cuda.graph's recipe asks before a capture.
  CapturedStep captured(at::Device(at::kCUDA, c10::cuda::current_device()), side_stream());
  int64_t nodes = -1;
  double capture_peak = 0;
  if (step.captures_itself()) {
    // The trainer runs its warm-up steps eagerly on its own side stream, then captures at the next step (and
    // replays it): the capture's peak, as below.
    const int64_t warmup = hierpar::strategy::AdversarialOptions{}.graph_warmup_steps;
    for (int64_t i = 0; i < warmup; ++i) step.run();
    at::cuda::getCurrentCUDAStream().synchronize();
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    step.run();
    at::cuda::getCurrentCUDAStream().synchronize();
    capture_peak = allocated_mb(true);
    nodes = step.graph_kernel_nodes();
  } else {
    for (int i = 0; i < 5; ++i) captured.warm_up([&] { step.run(); });
    at::cuda::getCurrentCUDAStream().synchronize();
  }
  if (graphs && !step.captures_itself()) {
    // A replay allocates nothing (the graph's private pool was filled while capturing), so a graph row's
    // memory is the peak allocated while capturing, which the pool keeps reserved from then on.
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    captured.capture([&] { step.run(); });
    at::cuda::getCurrentCUDAStream().synchronize();
    capture_peak = allocated_mb(true);
    nodes = captured.kernel_nodes();
  }
  const std::function<void()> one_step = graphs && !step.captures_itself()
                                             ? std::function<void()>([&] { captured.replay(0); })
                                             : std::function<void()>([&] { step.run(); });
  one_step();  // the first replay uploads the graph
  at::cuda::getCurrentCUDAStream().synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
  Timing t = time_cuda([&] { for (int i = 0; i < steps_per_sample; ++i) one_step(); }, 1, samples);
  // Less what was allocated before the row's models were built (cuBLAS workspaces of earlier rows' streams,
  // which stay allocated for the process), so rows run later are not charged for earlier ones.
  const double peak = std::max(allocated_mb(true), capture_peak) - allocated_before_mb;
  t.median_us /= steps_per_sample;
  t.min_us /= steps_per_sample;
  // HIERPAR_STEP_TRACE=DIR: each row's 3 profiled steps as a Chrome trace in DIR (where the step's time goes on
  // each stream: the critical path of a captured step, the operators behind an eager step's kernels).
  std::string trace_path;
  if (const char* dir = std::getenv("HIERPAR_STEP_TRACE")) {
    trace_path = std::string(dir) + "/" + bench + "-" + name_of(layers) + "-b" + std::to_string(batch) + "-" +
                 (bf16 ? "bf16" : "tf32") + "-" + (channels_last ? "cl" : "nchw") + "-graphs-" + (graphs ? "on" : "off") +
                 ".json";
  }
  const Profile prof = profile(one_step, 3, trace_path);

  Row row{bench, name_of(layers), bf16 ? "bf16" : "tf32", channels_last ? "channels_last" : "nchw", graphs ? "on" : "off",
          batch, t.median_us / 1e3, batch * 1e6 / t.median_us, prof.kernels, prof.busy_us, prof.conversions, peak,
          nodes};
  Config config;
  config.set("batch", batch)
      .set("precision", row.precision)
      .set("layout", row.layout)
      .set("graphs", row.graphs)
      .set("strategy", "single")
      .set("gpus", int64_t{1})
      .set("reduce", "none");
  Config extra;
  extra.set("ms_per_step", row.ms).set("images_per_s", row.images_per_s).set("peak_mem_mb", peak);
  extra.set("steps_per_sample", int64_t{steps_per_sample}).set("allocated_before_row_mb", allocated_before_mb);
  if (prof.available) {
    extra.set("kernels_per_step", prof.kernels)
        .set("gpu_busy_us_per_step", prof.busy_us)
        .set("layout_conversions_per_step", prof.conversions)
        .set("kernels_source", "kineto profile of 3 steps");
  }
  if (graphs) extra.set("graph_kernel_nodes", nodes);
  return {row, config, extra, t, prof};
}

// Reports a measured row (and its kernels to HIERPAR_STEP_PROFILE's file).
Row record(Report& report, const Measured& m, std::ofstream* profile_out) {
  const Row& row = m.row;
  const Profile& prof = m.profile;
  report.add(row.bench, row.impl, m.config, m.timing, m.extra);
  if (profile_out) {
    *profile_out << "== " << row.bench << " " << row.impl << " batch " << row.batch << " " << row.precision << " " << row.layout
                 << " graphs " << row.graphs << ": " << std::fixed << std::setprecision(3) << row.ms << " ms/step, "
                 << std::setprecision(1) << prof.kernels << " kernels/step, GPU busy " << prof.busy_us
                 << " us/step, NCHW<->NHWC conversions " << prof.conversions << "/step";
    if (row.graphs == "on") *profile_out << ", graph kernel nodes " << row.graph_nodes;
    *profile_out << "\n";
    write_kernels(*profile_out, prof);
    for (const auto& [caller, count] : prof.copies_by_caller) {
      *profile_out << "  copy " << std::setprecision(1) << count / 3.0 << "x/step  " << caller << "\n";
    }
    profile_out->unsetf(std::ios::fixed);
  }
  return row;
}

void release_memory() {
  at::cuda::getCurrentCUDAStream().synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
}

// Stock's and hierpar's row of one configuration. Eager steps are host-bound, and a shared host's speed drifts by
// tens of percent over seconds (batch 64 TF32 stock 6.4 to 8.0 ms/step in runs minutes apart on one H100;
// three sequential rounds of one row differed by 30%), so an eager row's ms/step comes from paired samples: both
// steps built and warmed, then kPairs samples of each in turn (stock, hierpar, stock, ...), each sample a CUDA-event
// time of steps_per_sample steps. Each row reports its median sample, and extra.paired_ratio the median over the
// pairs of stock's sample / hierpar's (drift within a pair is a few ms, so the ratio is what the two steps
// differ by). Peak memory and the profile come from each row measured alone. Graph rows are GPU-bound and steady:
// one timing.
constexpr int kPairs = 15;

void measure_pair(Report& report, std::vector<Row>& rows, const std::string& bench, int64_t batch, bool bf16,
                  bool channels_last, bool graphs, const Options& options, std::ofstream* profile_out,
                  const std::function<std::unique_ptr<TrainingStep>(LayerSet)>& make) {
  std::vector<Measured> measured;
  for (LayerSet layers : {LayerSet::stock, LayerSet::hierpar}) {
    at::manual_seed(0);
    {
      const double before = allocated_mb(false);
      const std::unique_ptr<TrainingStep> step = make(layers);
      measured.push_back(measure(bench, layers, batch, bf16, channels_last, graphs, *step, before, options));
    }
    release_memory();
  }
  if (!graphs && !options.quick) {
    at::manual_seed(0);
    const std::unique_ptr<TrainingStep> stock = make(LayerSet::stock);
    const std::unique_ptr<TrainingStep> hierpar = make(LayerSet::hierpar);
    for (int i = 0; i < 5; ++i) stock->run(), hierpar->run();
    at::cuda::getCurrentCUDAStream().synchronize();
    const int per_sample = batch <= 256 ? 50 : batch <= 1024 ? 20 : 10;
    std::vector<double> stock_ms, hierpar_ms, ratio;
    for (int pair = 0; pair < kPairs; ++pair) {
      const double s = time_cuda([&] { for (int i = 0; i < per_sample; ++i) stock->run(); }, 0, 1).median_us;
      const double h = time_cuda([&] { for (int i = 0; i < per_sample; ++i) hierpar->run(); }, 0, 1).median_us;
      stock_ms.push_back(s / per_sample / 1e3);
      hierpar_ms.push_back(h / per_sample / 1e3);
      ratio.push_back(s / h);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double paired_ratio = median(ratio);
    for (int side = 0; side < 2; ++side) {
      Measured& m = measured[side];
      const std::vector<double>& samples = side == 0 ? stock_ms : hierpar_ms;
      std::vector<double> samples_us;
      for (double ms : samples) samples_us.push_back(ms * 1e3);
      m.timing = timing_of(std::move(samples_us));
      m.row.ms = m.timing.median_us / 1e3;
      m.row.images_per_s = batch * 1e3 / m.row.ms;
      m.extra.set("ms_per_step", m.row.ms).set("images_per_s", m.row.images_per_s);
      m.extra.set("paired_samples_ms", samples).set("paired_ratio", side == 0 ? 1.0 : paired_ratio);
      m.row.paired_ratio = side == 0 ? 1.0 : paired_ratio;
    }
  }
  for (const Measured& m : measured) rows.push_back(record(report, m, profile_out));
}

void warm_side_stream() {
  const auto a = at::rand({64, 64}, at::TensorOptions().device(at::kCUDA));
  at::mm(a, a);
  {
    c10::cuda::CUDAStreamGuard guard(side_stream());
    at::mm(a, a);
    at::mm(a.to(at::kBFloat16), a.to(at::kBFloat16));
  }
  at::mm(a.to(at::kBFloat16), a.to(at::kBFloat16));
  at::cuda::device_synchronize();
}


void print_rows(const std::vector<Row>& rows) {
  // Each hierpar row against the stock row of the same configuration (eager rows: the paired ratio) and against
  // stock's best row (any layout, eager or graph) of the same batch and precision.
  auto find = [&](const Row& like, const char* impl, const std::string& graphs) -> const Row* {
    for (const auto& r : rows) {
      if (r.bench == like.bench && r.impl == impl && r.batch == like.batch && r.precision == like.precision &&
          r.layout == like.layout && r.graphs == graphs)
        return &r;
    }
    return nullptr;
  };
  std::cout << "\n" << std::left << std::setw(11) << "bench" << std::setw(8) << "impl" << std::right << std::setw(6)
            << "batch" << std::setw(6) << "prec" << std::setw(5) << "lay" << std::setw(7) << "graph" << std::setw(10) << "ms/step" << std::setw(11)
            << "img/s" << std::setw(9) << "kernels" << std::setw(8) << "conv" << std::setw(10) << "busy us"
            << std::setw(10) << "peak MB" << std::setw(12) << "stock/this" << std::setw(12) << "best stock/"
            << "\n";
  for (const auto& r : rows) {
    const Row* same = find(r, "stock", r.graphs);
    double best = 0;
    for (const auto& o : rows) {
      if (o.bench == r.bench && o.impl == "stock" && o.batch == r.batch && o.precision == r.precision)
        best = best > 0 ? std::min(best, o.ms) : o.ms;
    }
    std::cout << std::left << std::setw(11) << r.bench << std::setw(8) << r.impl << std::right << std::setw(6) << r.batch
              << std::setw(6) << r.precision << std::setw(5) << (r.layout == "nchw" ? "nchw" : "cl") << std::setw(7)
              << r.graphs << std::fixed << std::setprecision(3)
              << std::setw(10) << r.ms << std::setprecision(0) << std::setw(11) << r.images_per_s << std::setprecision(1)
              << std::setw(9) << r.kernels << std::setw(8) << r.conversions << std::setw(10) << r.busy_us
              << std::setw(10) << r.peak << std::setprecision(2) << std::setw(11) << (r.paired_ratio > 0 ? r.paired_ratio : same ? same->ms / r.ms : NAN)
              << "x" << std::setw(11) << (best > 0 ? best / r.ms : NAN) << "x\n";
    std::cout.unsetf(std::ios::fixed);
  }
}

void check_target(const std::vector<Row>& rows, const char* what, int64_t batch, const char* precision,
                  double limit_ms) {
  const Row* best = nullptr;
  for (const auto& r : rows) {
    if (r.bench == "dcgan_step" && r.impl == std::string("hierpar") && r.batch == batch && r.precision == precision &&
        (!best || r.ms < best->ms))
      best = &r;
  }
  if (!best) return;
  std::cout << "target " << what << ": hierpar best " << std::fixed << std::setprecision(3) << best->ms
            << " ms/step (graphs " << best->graphs << ") vs <= " << limit_ms << ": "
            << (best->ms <= limit_ms ? "MET" : "NOT MET") << "\n";
  std::cout.unsetf(std::ios::fixed);
}

// ms/step of every dcgan_step row as bars: one group per (batch, precision, layout; CL = channels_last), stock and
// hierpar, eager and graph.
void write_chart(const std::vector<Row>& rows, const std::string& path) {
  write_chart_file(path, [&]([[maybe_unused]] const std::string& file) {
#ifdef HIERPAR_BENCH_CHARTS
    using hierpar::examples::BarGroup;
    using hierpar::examples::PlotSeries;
    const std::vector<std::pair<std::string, std::string>> kinds{
        {"stock", "off"}, {"hierpar", "off"}, {"stock", "on"}, {"hierpar", "on"}};
    const std::vector<PlotSeries> series{{"stock eager", {}, {158, 202, 225}},
                                         {"hierpar eager", {}, {253, 174, 107}},
                                         {"stock CUDA graph", {}, {33, 113, 181}},
                                         {"hierpar CUDA graph", {}, {217, 72, 1}}};
    std::vector<BarGroup> groups;
    for (const auto& r : rows) {
      if (r.bench != "dcgan_step") continue;
      const std::string label =
          "b" + std::to_string(r.batch) + " " + r.precision + (r.layout == "nchw" ? " NCHW" : " CL");
      BarGroup& group = hierpar::examples::bar_group(groups, label, kinds.size());
      for (size_t k = 0; k < kinds.size(); ++k) {
        if (kinds[k].first == r.impl && kinds[k].second == r.graphs) group.values[k] = r.ms;
      }
    }
    hierpar::examples::write_bar_chart(groups, series, "DCGAN training step, ms/step (lower is better)", file,
                                       std::max<int>(900, 150 * static_cast<int>(groups.size())), 440);
#endif
  });
}

void dcgan_step_suite(Report& report, const Options& options) {
  namespace hs = hierpar::strategy;
  // Stock at its strongest: TF32 for float32 convolutions and matmuls, as the trainer's tf32 and bf16 precisions.
  const hs::PrecisionScope tf32(hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CUDA));
  const char* profile_path = std::getenv("HIERPAR_STEP_PROFILE");
  std::unique_ptr<std::ofstream> profile_out;
  if (profile_path) profile_out = std::make_unique<std::ofstream>(profile_path);
  const std::vector<int64_t> batches = options.any_batches(options.quick ? std::vector<int64_t>{64, 1024}
                                                                         : std::vector<int64_t>{64, 256, 1024, 4096});
  std::vector<Row> rows;
  // --skip TEXT leaves out the stock/hierpar pairs whose label contains TEXT, e.g. "graphs off" or "cnn_step".
  std::vector<std::string> skipped;
  auto skip = [&](const std::string& label) { return options.skips(label, skipped); };
  warm_side_stream();
  for (int64_t batch : batches) {
    for (const auto& [bf16, channels_last] : {std::pair{false, false}, std::pair{false, true}, std::pair{true, true}}) {
      for (bool graphs : {false, true}) {
        if (skip("dcgan_step batch " + std::to_string(batch) + (bf16 ? " bf16" : " tf32") +
                 (channels_last ? " channels_last" : " nchw") + (graphs ? " graphs on" : " graphs off"))) {
          continue;
        }
        measure_pair(report, rows, "dcgan_step", batch, bf16, channels_last, graphs, options, profile_out.get(),
                     [&, bf16 = bf16, channels_last = channels_last](LayerSet layers) -> std::unique_ptr<TrainingStep> {
                       if (layers == LayerSet::stock) return std::make_unique<StockDcganStep>(batch, bf16, channels_last);
                       return std::make_unique<TrainerStep>(batch, bf16, channels_last, graphs);
                     });
      }
    }
  }
  for (int64_t batch : {8, 128}) {
    for (bool graphs : {false, true}) {
      if (skip("cnn_step batch " + std::to_string(batch) + " tf32 nchw" + (graphs ? " graphs on" : " graphs off"))) continue;
      measure_pair(report, rows, "cnn_step", batch, false, false, graphs, options, profile_out.get(),
                   [batch](LayerSet layers) { return std::make_unique<CnnStep>(layers, batch); });
    }
  }
  print_rows(rows);
  for (const std::string& row : skipped) std::cout << "  skipped " << row << "\n";
  if (!options.out_prefix.empty() && !rows.empty()) write_chart(rows, options.out_prefix + ".png");
  check_target(rows, "batch 64 tf32 <= 1.0 ms", 64, "tf32", 1.0);
  check_target(rows, "batch 1024 bf16+channels_last <= 4.0 ms", 1024, "bf16", 4.0);
  for (const auto& stock : rows) {
    if (stock.bench != "dcgan_step" || stock.impl != "stock" || stock.batch != 1024 || stock.precision != "bf16") continue;
    for (const auto& ours : rows) {
      if (ours.bench == stock.bench && ours.impl == "hierpar" && ours.batch == 1024 && ours.precision == "bf16" &&
          ours.graphs == stock.graphs) {
        std::cout << "target peak memory at batch 1024 bf16, graphs " << ours.graphs << ": hierpar " << std::fixed
                  << std::setprecision(1) << ours.peak << " MB vs stock " << stock.peak << " MB: "
                  << (ours.peak <= stock.peak ? "MET" : "NOT MET") << "\n";
        std::cout.unsetf(std::ios::fixed);
      }
    }
  }
}

// The chart again from a record (`hierpar-bench dcgan_step --redraw RECORD.json`).
void redraw_dcgan_step_chart(const nlohmann::json& records, const std::string& png) {
  std::vector<Row> rows;
  for (const auto& r : records) {
    const auto& c = r.at("config");
    Row row{};
    row.bench = r.at("bench").get<std::string>();
    row.impl = r.at("impl").get<std::string>();
    row.precision = c.at("precision").get<std::string>();
    row.layout = c.at("layout").get<std::string>();
    row.graphs = c.at("graphs").get<std::string>();
    row.batch = c.at("batch").get<int64_t>();
    row.ms = r.at("median_us").get<double>() / 1000.0;
    rows.push_back(row);
  }
  write_chart(rows, png);
}

HIERPAR_BENCH_SUITE("dcgan_step", dcgan_step_suite);
const bool dcgan_step_redraw = register_redraw("dcgan_step", redraw_dcgan_step_chart);

}  // namespace
