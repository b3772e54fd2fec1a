// Suite "strategy": seed 000's Table 2 on the GPUs present. One DCGAN training step (the seed's network:
// 64x64x3 images, 256-128-64-32 channels) through hierpar::strategy::AdversarialTrainer under each
// placement -- single (1 GPU), task (G and D on 2 GPUs), data (a replica per GPU, 2 and 4), hierarchical
// (2 replicas x (G GPU, D GPU) = 4 GPUs) -- each multi-replica scheme with host and NCCL averaging, at
// global batches 64 (the seed's), 1024 and 4096 in tf32 (float32 with TF32), and 1024 and 4096 in bf16
// (hierpar::strategy::StepPrecision, which the trainer applies to its steps). The stock row is the
// same trainer on one GPU with torch::nn layers and one stream (overlap_passes off); every other row uses hierpar's
// layers. data (2, nccl) runs three ways: bucketed all-reduce during the backward, captured in the backward's graph
// (the default), one flat buffer after it, between the replayed segments (config buckets = flat), and bucketed with
// synchronized BatchNorm (sync_bn, eager); data (4, nccl) and hierarchical (nccl) run the first two, and every host
// row runs both: bucket copies to the host captured in the graph (capture_host_copies) and flat. Three eager rows (config
// graphs = off) show the eager step's averaging on 2 GPUs: host buckets summed during the backward, one flat host
// buffer after it, and NCCL's buckets. The JSON is rewritten after every row.
//
// Timing: a run is K steps between device synchronisations of every GPU of the placement (host wall
// clock: the step spans several GPUs, so no single stream's events bracket it); after warm-up steps,
// the median over several runs. Each replica's share of the batch is already on its D device (as a data
// loader per replica would leave it), so no input crosses devices inside the timed step.
// Every row runs with FusedAdam as CUDA graphs (config graphs = on; every placement is captured, each device's part
// on that device); bf16 rows use the trainer's autocast and channels_last options.
// extra: images_per_s (global batch / step time), epoch_s (seconds for the seed's epoch of 2944 images at that
// rate) and, for rows on several GPUs, idle_<device>: the fraction of a step each GPU runs none of the step's
// compute (from the trainer's timeline over two steady-state steps: 1 - the union of its compute spans / the two
// steps' span). Task and hierarchical rows also write <gpu>-strategy-trace-<row>.json: a Chrome trace
// (chrome://tracing, ui.perfetto.dev) of two consecutive steps, one row per GPU.
// Rows needing more GPUs than present are skipped, and the output says so.
// Under torchrun (`torchrun --nproc-per-node P hierpar-bench strategy`) the captured multi-replica rows run with their
// replicas spread over the P processes (one process per replica where the row has P replicas: PyTorch DDP's layout),
// task and hierarchical rows on P GPUs with G and D of each replica in two processes (a split placement; rank 0 runs
// G and times the step it waits for), the label says "P processes", rank 0 prints and writes
// <gpu>-strategy-Pprocs.json, and the rows that one process runs alone (single, the eager and sync BN rows) are left
// out: compare with the in-process run's record.
#include "bench.h"

#include "hierpar/models/dcgan.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/precision.h"
#include "hierpar/strategy/placement.h"

#ifdef HIERPAR_BENCH_CHARTS
#include "common/images.h"
#endif

#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace hierpar::bench;
namespace hs = hierpar::strategy;

constexpr double kEpochImages = 2944;  // the seed's data set

struct Row {
  const char* strategy;
  int64_t gpus;
  const char* reduce;  // "none" where one replica has nothing to average
  hierpar::LayerSet layers;
  // "bucketed" (the default: DDP-style buckets, 1 MB first bucket then 25 MB, all-reduced (NCCL) or copied to the
  // host and summed (host) during the backward; captured in the graphs) or "flat" (one buffer per network after the
  // backward, between the replayed segments).
  const char* buckets = "bucketed";
  bool sync_bn = false;  // synchronized BatchNorm across the replicas
  // Captured as CUDA graphs (every row but the eager averaging ones, which show what the eager step's bucketed
  // averaging does: host buckets summed during the backward against one flat buffer after it, and NCCL's; and the
  // schedule rows).
  bool graphs = true;
  // AdversarialOptions::schedule: the pipelined schedule (G one step ahead; eager), against the exact one eager.
  bool pipelined = false;
};


void to_channels_last(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters())
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
}

std::vector<c10::Device> devices_of(const hs::Placement& placement) {
  std::vector<c10::Device> devices;
  for (const auto& r : placement.replicas) {
    for (const c10::Device& d : {r.generator, r.discriminator})
      if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  }
  return devices;
}

// Median and minimum microseconds per step over `runs` runs of `steps` steps, after `warmup` steps.
Timing time_steps(hs::AdversarialTrainer& trainer, const std::vector<torch::Tensor>& reals, int warmup, int steps,
                  int runs) {
  const auto devices = devices_of(trainer.placement());
  auto sync = [&] {
    for (const auto& d : devices) torch::cuda::synchronize(d.index());
  };
  for (int i = 0; i < warmup; ++i) trainer.step_shares(reals);
  sync();
  std::vector<double> us;
  for (int run = 0; run < runs; ++run) {
    sync();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) trainer.step_shares(reals);
    sync();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / steps);
  }
  return timing_of(std::move(us));
}

struct Result {
  std::string label;
  std::string placement, group;  // the chart's series (placement, reduction, layers) and group (batch, precision)
  double seconds_per_epoch, images_per_s;
};

// Per device, the fraction of steps [first, first + 2) during which it ran no compute span of the step.
std::vector<std::pair<std::string, double>> idle_fractions(const std::vector<hs::TimelineSpan>& spans, int64_t first) {
  std::vector<std::pair<std::string, double>> out;
  std::vector<c10::Device> devices;
  double begin = 1e300, end = -1e300;
  for (const auto& s : spans) {
    if (s.step < first || s.step >= first + 2) continue;
    begin = std::min(begin, s.start_ms);
    end = std::max(end, s.end_ms);
    if (std::find(devices.begin(), devices.end(), s.device) == devices.end()) devices.push_back(s.device);
  }
  for (const c10::Device& device : devices) {
    std::vector<std::pair<double, double>> busy;
    for (const auto& s : spans) {
      if (s.device == device && s.compute && s.step >= first && s.step < first + 2) busy.emplace_back(s.start_ms, s.end_ms);
    }
    std::sort(busy.begin(), busy.end());
    double covered = 0, reach = begin;
    for (auto [a, b] : busy) {  // the union of the intervals
      a = std::max(a, reach);
      if (b > a) covered += b - a;
      reach = std::max(reach, b);
    }
    out.emplace_back(device.str(), end > begin ? 1.0 - covered / (end - begin) : 0.0);
  }
  return out;
}

// A row's series in the chart: placement, reduction and what differs from the default row, e.g. "data 4 nccl flat".
std::string placement_label(const std::string& strategy, int64_t gpus, const std::string& reduce,
                            const std::string& buckets, bool graphs, bool pipelined, bool sync_bn, bool stock,
                            int64_t processes) {
  return strategy + " " + std::to_string(gpus) + (reduce == "none" ? "" : " " + reduce) +
         (buckets == "flat" ? " flat" : "") + (graphs ? "" : " eager") + (pipelined ? " pipelined" : "") +
         (sync_bn ? " sync BN" : "") + (stock ? " stock" : "") +
         (processes > 1 ? " " + std::to_string(processes) + " procs" : "");
}

// A row's group in the chart: its global batch and precision.
std::string chart_group(int64_t batch, const std::string& precision) {
  return "b" + std::to_string(batch) + " " + precision;
}

// Thousands of images/s per placement (bars), one group per batch and precision: <gpu>-strategy.png.
void write_chart(const std::vector<Result>& results, const std::string& path) {
  write_chart_file(path, [&]([[maybe_unused]] const std::string& file) {
#ifdef HIERPAR_BENCH_CHARTS
    using hierpar::examples::BarGroup;
    using hierpar::examples::PlotSeries;
    std::vector<PlotSeries> series;
    std::vector<BarGroup> groups;
    for (const Result& r : results) {
      auto si = std::find_if(series.begin(), series.end(), [&](const PlotSeries& p) { return p.name == r.placement; });
      if (si == series.end()) {
        static const std::vector<std::array<uint8_t, 3>> colours{{120, 120, 120}, {217, 72, 1},   {253, 174, 107},
                                                                 {33, 113, 181},  {107, 174, 214}, {35, 139, 69},
                                                                 {116, 196, 118}, {117, 107, 177}, {188, 189, 220},
                                                                 {203, 24, 29},   {251, 106, 74},
                                                                 {140, 81, 10},   {1, 102, 94},
                                                                 {223, 101, 176}, {102, 102, 0},  {0, 0, 0}};
        series.push_back({r.placement, {}, colours[series.size() % colours.size()]});
        for (auto& g : groups) g.values.push_back(NAN);
        si = series.end() - 1;
      }
      const auto column = static_cast<size_t>(si - series.begin());
      hierpar::examples::bar_group(groups, r.group, series.size()).values[column] = r.images_per_s / 1000.0;
    }
    hierpar::examples::write_bar_chart(groups, series, "DCGAN step, thousands of images/s (higher is better)", file,
                                       std::max<int>(1000, 260 * static_cast<int>(groups.size())), 480);
#endif
  });
}

// Steps [first, first + 2) as a Chrome trace: a process per GPU, a thread per replica on it.
void write_trace(const std::vector<hs::TimelineSpan>& spans, int64_t first, const std::string& path) {
  double zero = 1e300;
  for (const auto& s : spans) {
    if (s.step >= first && s.step < first + 2) zero = std::min(zero, s.start_ms);
  }
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  for (const auto& s : spans) {
    if (s.step < first || s.step >= first + 2) continue;
    events.push_back({{"name", s.piece + " (step " + std::to_string(s.step - first + 1) + ")"},
                      {"cat", s.compute ? "compute" : "transfer"},
                      {"ph", "X"},
                      {"pid", "GPU " + s.device.str()},
                      {"tid", "replica " + std::to_string(s.replica)},
                      {"ts", (s.start_ms - zero) * 1e3},
                      {"dur", (s.end_ms - s.start_ms) * 1e3}});
  }
  std::ofstream out(path);
  out << nlohmann::ordered_json{{"displayTimeUnit", "ms"}, {"traceEvents", std::move(events)}}.dump(1) << "\n";
}

void strategy_suite(Report& report, const Options& options) {
  const int64_t visible = static_cast<int64_t>(torch::cuda::device_count());
  const bool launched = options.world_size > 1;
  const bool reports = options.rank == 0;
  const hs::Launch launch = launched ? hs::Launch::from_env() : hs::Launch{};
  const std::vector<Row> rows = {
      {"single", 1, "none", hierpar::LayerSet::stock},   {"single", 1, "none", hierpar::LayerSet::hierpar},
      {"task", 2, "none", hierpar::LayerSet::hierpar},   {"data", 2, "host", hierpar::LayerSet::hierpar},
      {"data", 2, "host", hierpar::LayerSet::hierpar, "flat"},
      {"data", 2, "nccl", hierpar::LayerSet::hierpar},
      {"data", 2, "nccl", hierpar::LayerSet::hierpar, "flat"},
      {"data", 2, "nccl", hierpar::LayerSet::hierpar, "bucketed", true},
      {"hierarchical", 4, "host", hierpar::LayerSet::hierpar},
      {"hierarchical", 4, "host", hierpar::LayerSet::hierpar, "flat"},
      {"hierarchical", 4, "nccl", hierpar::LayerSet::hierpar},
      {"hierarchical", 4, "nccl", hierpar::LayerSet::hierpar, "flat"},
      {"data", 4, "host", hierpar::LayerSet::hierpar},
      {"data", 4, "host", hierpar::LayerSet::hierpar, "flat"},
      {"data", 4, "nccl", hierpar::LayerSet::hierpar},
      {"data", 4, "nccl", hierpar::LayerSet::hierpar, "flat"},
      {"data", 2, "host", hierpar::LayerSet::hierpar, "bucketed", false, /*graphs=*/false},
      {"data", 2, "host", hierpar::LayerSet::hierpar, "flat", false, /*graphs=*/false},
      {"data", 2, "nccl", hierpar::LayerSet::hierpar, "bucketed", false, /*graphs=*/false},
      {"task", 2, "none", hierpar::LayerSet::hierpar, "bucketed", false, /*graphs=*/false},
      {"task", 2, "none", hierpar::LayerSet::hierpar, "bucketed", false, /*graphs=*/false, /*pipelined=*/true},
  };
  struct Case {
    int64_t batch;
    hs::StepPrecision precision;
  };
  const auto tf32 = hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CUDA);
  const auto bf16 = hs::StepPrecision::from_flags("bf16", true, c10::DeviceType::CUDA);
  std::vector<Case> cases = {{64, tf32}, {1024, tf32}, {1024, bf16}, {4096, tf32}, {4096, bf16}};
  if (options.quick) cases = {{64, tf32}, {1024, tf32}};
  if (!options.batches.empty()) {  // --batches narrows the cases to those global batches
    std::vector<Case> picked;
    for (const Case& c : cases) {
      if (!options.pick_batches({c.batch}).empty()) picked.push_back(c);
    }
    cases = picked;
  }
  const int runs = options.quick ? 3 : 5;
  hs::AdversarialOptions trainer_options;  // DCGAN's Adam (2e-4, beta1 0.5), BCE with logits

  std::vector<Result> results;
  std::vector<std::string> skipped;
  for (const Case& c : cases) {
    for (const Row& row : rows) {
      // Buckets matter to every averaging row: captured, bucketed rows capture the all-reduces (NCCL) or the copies
      // to the host (host) in the backward's graph; flat rows average one buffer per network between the segments.
      const bool bucketing = std::string(row.reduce) != "none";
      const std::string label = std::string(row.strategy) + " " + std::to_string(row.gpus) + " GPU" +
                                (row.gpus > 1 ? "s" : "") + ", reduce " + row.reduce +
                                (bucketing ? std::string(" ") + row.buckets : std::string()) +
                                (row.graphs ? "" : ", eager") + (row.pipelined ? ", pipelined" : "") +
                                (row.sync_bn ? ", sync BN" : "") + ", " +
                                (row.layers == hierpar::LayerSet::stock ? "stock" : "hierpar") + " layers, batch " +
                                std::to_string(c.batch) + " " + c.precision.name() +
                                (launched ? ", " + std::to_string(options.world_size) + " processes" : "");
      if (options.skips(label, skipped)) continue;
      if (launched) {
        const std::string scheme = row.strategy;
        const int64_t per_replica = scheme == "hierarchical" ? 2 : 1;
        // task and hierarchical with a process per GPU: G and D of a replica in two processes (a split placement).
        const bool split = (scheme == "task" || scheme == "hierarchical") && row.gpus == options.world_size;
        std::string why;
        if ((std::string(row.reduce) == "none" && !split) || row.sync_bn || !row.graphs || row.pipelined) {
          why = "one process runs it (see the in-process record)";
        } else if (!split && (row.gpus % options.world_size != 0 || (row.gpus / options.world_size) % per_replica != 0)) {
          why = "its " + std::to_string(row.gpus) + " GPUs do not split into whole replicas over " +
                std::to_string(options.world_size) + " processes";
        }
        if (!why.empty()) {
          skipped.push_back(label + ": " + why);
          continue;
        }
      }
      if (row.gpus > visible) {
        skipped.push_back(label + ": needs " + std::to_string(row.gpus) + " GPUs, " + std::to_string(visible) +
                          " present");
        continue;
      }
      try {
        const auto placement = hs::Placement::make(hs::parse_scheme(row.strategy), row.gpus,
                                                   std::string(row.reduce) == "nccl" ? hs::Reduce::collective
                                                                                     : hs::Reduce::host,
                                                   c10::DeviceType::CUDA, launch);
        hierpar::models::DCGANOptions model;  // the seed's: nz 100, 64x64x3, width 1
        model.layers = row.layers;
        torch::manual_seed(0);
        hierpar::models::Generator g(model);
        hierpar::models::Discriminator d(model);
        if (c.precision.channels_last) {
          to_channels_last(*g);
          to_channels_last(*d);
        }
        trainer_options.noise_shape = {model.nz};
        // Every row at its fastest but the eager ones: FusedAdam and CUDA graphs (the row's config says whether the
        // trainer captured).
        trainer_options.fused_adam = true;
        trainer_options.fused_adam_kernel =
            row.layers == hierpar::LayerSet::stock ? hs::AdamKernel::aten : hs::AdamKernel::hierpar;
        trainer_options.cuda_graphs = row.graphs;
        // The stock row on one stream, as stock LibTorch code runs a step.
        trainer_options.overlap_passes = row.layers != hierpar::LayerSet::stock;
        trainer_options.precision = c.precision;
        trainer_options.averaging.bucket_cap_bytes =
            std::string(row.buckets) == "flat" ? 0 : hs::AveragingOptions{}.bucket_cap_bytes;
        trainer_options.averaging.capture_host_copies = std::string(row.buckets) != "flat";
        trainer_options.sync_batch_norm = row.sync_bn;
        trainer_options.schedule = row.pipelined ? hs::Schedule::pipelined : hs::Schedule::exact;
        // A row's collectives take milliseconds: one that stalls should cost a minute of the run, not the
        // default five (in-process NCCL stalls have been seen at batch 4096; docs/strategy.md).
        trainer_options.averaging.timeout = std::chrono::seconds(60);
        hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, trainer_options);
        const int64_t share = c.batch / placement.global_replicas();
        std::vector<torch::Tensor> reals;
        for (const auto& r : placement.replicas) {
          auto real = torch::rand({share, model.channels, model.image_size, model.image_size},
                                  torch::TensorOptions().device(r.discriminator)) * 2 - 1;
          reals.push_back(c.precision.channels_last ? real.contiguous(at::MemoryFormat::ChannelsLast) : real);
        }
        const int steps = static_cast<int>(std::clamp<int64_t>((8192 + c.batch - 1) / c.batch, 5, 30));
        const Timing t = time_steps(trainer, reals, /*warmup=*/5, steps, runs);
        // The losses of every step must be finite: a broken step timed fast is no result.
        const torch::Tensor losses = trainer.take_losses();
        TORCH_CHECK(losses.size(0) > 0 && losses.isfinite().all().item<bool>(), "non-finite losses in the timed steps: ",
                    losses.isfinite().logical_not().sum().item<int64_t>(), " of ", losses.numel());
        const double images_per_s = c.batch / (t.median_us * 1e-6);
        const double epoch_s = kEpochImages / images_per_s;
        // The GPUs' idle time in two steady-state steps (and their trace), from the trainer's timeline.
        std::vector<std::pair<std::string, double>> idle;
        if (row.gpus > 1 && !launched) {  // the timeline sees this process's GPUs only
          trainer.record_timeline(true);
          for (int i = 0; i < 3; ++i) trainer.step_shares(reals);
          const auto spans = trainer.timeline();
          trainer.record_timeline(false);
          const int64_t first = spans.empty() ? 0 : spans.front().step + 1;  // the first step may start from idle
          idle = idle_fractions(spans, first);
          const std::string scheme = row.strategy;
          if (!options.out_prefix.empty() && (scheme == "task" || scheme == "hierarchical")) {
            write_trace(spans, first, options.out_prefix + "-trace-" + scheme + "-" + row.reduce +
                                          (std::string(row.buckets) == "flat" ? "-flat" : "") +
                                          (row.graphs ? "" : "-eager") + (row.pipelined ? "-pipelined" : "") + "-b" +
                                          std::to_string(c.batch) + "-" + c.precision.name() + ".json");
          }
        }
        Config config;
        config.set("batch", c.batch)
            .set("precision", c.precision.name())
            .set("layout", c.precision.layout())
            .set("graphs", trainer.graphs() ? "on" : "off")
            .set("strategy", row.strategy)
            .set("gpus", row.gpus)
            .set("reduce", row.reduce)
            .set("buckets", bucketing ? row.buckets : "none")
            .set("sync_bn", row.sync_bn)
            .set("schedule", hs::to_string(trainer_options.schedule))
            .set("processes", options.world_size)
            .set("graph_averaging", hs::to_string(trainer.graph_averaging()));
        Config extra;
        extra.set("images_per_s", images_per_s).set("epoch_s", epoch_s).set("steps_per_run", steps);
        std::string idle_text;
        for (const auto& [device, fraction] : idle) {
          extra.set("idle_" + device, fraction);
          char buffer[48];
          std::snprintf(buffer, sizeof buffer, " %s %.0f%%", device.c_str(), 100 * fraction);
          idle_text += buffer;
        }
        report.add("dcgan_step", row.layers == hierpar::LayerSet::stock ? "stock" : "hierpar", config, t, extra);
        const std::string shown = label + (trainer.graphs() ? ", graphs" : ", eager");
        results.push_back({shown,
                           placement_label(row.strategy, row.gpus, row.reduce, row.buckets, row.graphs, row.pipelined,
                                           row.sync_bn, row.layers == hierpar::LayerSet::stock, options.world_size),
                           chart_group(c.batch, c.precision.name()), epoch_s, images_per_s});
        // The JSON after every row: a crash or the caller's time limit loses only the rows not yet run.
        if (!reports) continue;
        if (!options.out_prefix.empty()) report.write_json(options.out_prefix + ".json");
        std::printf("  %-80s %9.3f ms/step %11.0f images/s %8.4f s/epoch%s%s\n", shown.c_str(), t.median_us / 1000.0,
                    images_per_s, epoch_s, idle.empty() ? "" : "  idle:", idle_text.c_str());
        std::fflush(stdout);
      } catch (const std::exception& e) {
        std::string what = e.what();
        what = what.substr(0, what.find('\n'));
        skipped.push_back(label + ": FAILED: " + what);
        std::printf("  %-72s FAILED: %s\n", label.c_str(), what.c_str());
        std::fflush(stdout);
      }
    }
  }
  if (!reports) return;
  std::cout << "\nTable 2 (seed 000) on " << visible << " GPU(s): seconds per epoch of " << kEpochImages
            << " images and images/s\n";
  for (const auto& r : results)
    std::printf("  %-80s %8.4f s/epoch %11.0f images/s\n", r.label.c_str(), r.seconds_per_epoch, r.images_per_s);
  for (const auto& s : skipped) std::cout << "  skipped " << s << "\n";
  if (!options.out_prefix.empty() && !results.empty()) write_chart(results, options.out_prefix + ".png");
}

// The chart again from a record (`hierpar-bench strategy --redraw RECORD.json`).
void redraw_strategy_chart(const nlohmann::json& records, const std::string& png) {
  std::vector<Result> results;
  for (const auto& r : records) {
    const auto& c = r.at("config");
    const double images_per_s = r.at("images_per_s").get<double>();
    results.push_back({"",
                       placement_label(c.at("strategy").get<std::string>(), c.at("gpus").get<int64_t>(),
                                       c.at("reduce").get<std::string>(), c.at("buckets").get<std::string>(),
                                       c.at("graphs").get<std::string>() == "on",
                                       c.value("schedule", std::string("exact")) == "pipelined",
                                       c.at("sync_bn").get<bool>(),
                                       r.at("impl").get<std::string>() == "stock", c.value("processes", int64_t{1})),
                       chart_group(c.at("batch").get<int64_t>(), c.at("precision").get<std::string>()),
                       kEpochImages / images_per_s, images_per_s});
  }
  write_chart(results, png);
}

}  // namespace

HIERPAR_BENCH_SUITE("strategy", strategy_suite);
const bool strategy_redraw = hierpar::bench::register_redraw("strategy", redraw_strategy_chart);
