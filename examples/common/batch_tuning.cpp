#include "common/batch_tuning.h"

#include "common/cli.h"
#include "common/images.h"
#include "hierpar/nn/recompute.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/gpu_utilization.h"

#ifdef HIERPAR_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

namespace hierpar::examples {
namespace hs = hierpar::strategy;

namespace {

std::vector<torch::Device> cuda_devices_of(const hs::Placement& placement) {
  std::set<c10::DeviceIndex> seen;
  std::vector<torch::Device> devices;
  for (const auto& r : placement.replicas) {
    for (const torch::Device& d : {r.generator, r.discriminator}) {
      if (d.is_cuda() && seen.insert(d.index()).second) devices.push_back(d);
    }
  }
  return devices;
}

}  // namespace

std::string out_of_memory_note(const std::string& message) {
  auto between = [&](const std::string& from, const std::string& to) -> std::string {
    const size_t begin = message.find(from);
    if (begin == std::string::npos) return {};
    const size_t end = message.find(to, begin + from.size());
    return end == std::string::npos ? std::string() : message.substr(begin + from.size(), end - begin - from.size());
  };
  const std::string asked = between("Tried to allocate ", ". ");
  const std::string held = between("Of the allocated memory ", " is allocated by PyTorch");
  if (asked.empty()) return "out of memory";
  return "out of memory: asked for " + asked + (held.empty() ? "" : " with " + held + " allocated");
}

hs::BatchTrial measure_dcgan_steps(const DCGANTrainConfig& config, int64_t batch, int64_t dataset_size,
                                   int64_t steps, double timed_seconds,
                                   const std::shared_ptr<hs::ProcessGroupCache>& process_groups) {
  using clock = std::chrono::steady_clock;
  const auto trial_began = clock::now();
  auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  const hs::Placement placement = dcgan_placement(config);
  if (placement.launch.multi_process()) throw FlagError("tune runs in one process: start it without torchrun");
  const StepSettings step = step_settings(config, placement.replicas[0].discriminator.type());
  hs::AdversarialOptions options = trainer_options(config, step);
  // One eager step before the capture makes the lazy initialisations it needs (the trainer accepts none); each more
  // is a step the search pays for at every batch. Eagerly the 3 warm-up steps let --memory offload plan.
  options.graph_warmup_steps = std::min<int64_t>(options.graph_warmup_steps, 1);
  options.loss_log_steps = steps + options.graph_warmup_steps + 4;  // no loss read-back inside the timed steps
  options.report_failures = false;
  options.averaging.process_groups = process_groups;
  const auto devices = cuda_devices_of(placement);
  const torch::Device data_device = placement.replicas[0].discriminator;

  hs::BatchTrial trial;
  trial.batch = batch;
  std::unique_ptr<hs::AdversarialTrainer> trainer;
  const hs::PrecisionScope precision(step.precision);  // the trials compute as the run they stand for will
#ifdef HIERPAR_WITH_CUDA
  // The peak over the whole trial: replayed CUDA graphs allocate nothing, so a captured step's memory shows only
  // in its eager warm-up step and its capture.
  // The allocator's statistics exist once CUDA has started (the first trial is its first use in the process).
  if (!devices.empty()) at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  for (const auto& d : devices) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
  try {
    torch::manual_seed(static_cast<uint64_t>(config.seed));
    models::Generator generator(config.model);
    models::Discriminator discriminator(config.model);
    trainer = std::make_unique<hs::AdversarialTrainer>(torch::nn::AnyModule(generator),
                                                       torch::nn::AnyModule(discriminator), placement, options);
    const int64_t size = config.model.image_size;
    // Drawn where it is used (from the generator the seed above set): on the CPU, one batch of 16384 x 3 x 128 x 128
    // takes 6 s on two cores, longer than the trial's steps.
    const torch::Tensor real =
        torch::rand({batch, config.model.channels, size, size}, torch::TensorOptions().device(data_device))
            .mul_(2)
            .sub_(1);
    trial.build_seconds = since(trial_began);
    // Warm-up: the first steps, and with CUDA graphs the capture, are not what a run's steps cost. The step that
    // captures also replays the graphs once, so the timed steps are the graphs' second replay on.
    const int64_t warmup_steps = options.cuda_graphs ? options.graph_warmup_steps + 1 : options.graph_warmup_steps + 2;
    for (int64_t i = 0; i < warmup_steps; ++i) trainer->step(real);
    // Started before the clock: the first trial's sampler loads and initialises NVML, which inside the timed steps
    // made the first batch's about 20 ms longer (its s/epoch twice the next batch's in the H100 and H200 records).
    std::optional<hs::UtilizationSampler> sampler;
    if (steps > 0) sampler.emplace(data_device, std::chrono::milliseconds(20));
    synchronize_devices(placement);
    const auto begin = clock::now();
    trial.setup_seconds = std::chrono::duration<double>(begin - trial_began).count();
    if (steps == 0) {
      trial.fits = true;
      trainer.reset();
      trial.trial_seconds = since(trial_began);
      return trial;
    }
    int64_t target = steps;
    while (trial.timed_steps < target) {
      trainer->step(real);
      // After 3 steps the clock (read after a synchronisation) gives their pace, and the trial runs as many steps as
      // fill timed_seconds at it: one stall of the queue, and no steps past the time the search pays for.
      if (++trial.timed_steps == 3 && timed_seconds > 0) {
        synchronize_devices(placement);
        const double pace = since(begin) / 3.0;
        target = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(timed_seconds / pace)), 3, steps);
      }
    }
    synchronize_devices(placement);
    const double seconds = since(begin);
    trial.gpu_usage = hs::top_half_mean(sampler->stop());
    trial.fits = true;
    trial.step_seconds = seconds / static_cast<double>(trial.timed_steps);
    trial.epoch_seconds = trial.step_seconds * std::ceil(static_cast<double>(dataset_size) / static_cast<double>(batch));
    trial.images_per_second = static_cast<double>(batch) / trial.step_seconds;
#ifdef HIERPAR_WITH_CUDA
    for (const auto& d : devices) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
      trial.peak_bytes = std::max<int64_t>(trial.peak_bytes, stats.allocated_bytes[0].peak);
    }
#endif
    // With --memory offload, what the timed steps kept on the GPU (the plan made during the warm-up).
    for (const auto& d : devices) {
      const std::string plan = hierpar::nn::offload_plan_summary(d);
      if (!plan.empty()) trial.note += (trial.note.empty() ? "" : "; ") + plan;
    }
  } catch (const c10::OutOfMemoryError& e) {
    trial.fits = false;
    trial.note = out_of_memory_note(e.what_without_backtrace());
  }
  trainer.reset();
#ifdef HIERPAR_WITH_CUDA
  // After running out of memory the cache is given back. A trial that fit leaves it to the next, which would
  // otherwise allocate it again from the driver; the allocator frees cached blocks itself before it reports one.
  if (!trial.fits && !devices.empty()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  trial.trial_seconds = since(trial_began);
  return trial;
}

hs::BatchSearchResult tune_batch_size(DCGANTrainConfig config, const TuneConfig& tune, std::ostream& out) {
  resolve_model(config);
  hs::BatchSearchOptions options;
  try {
    options.objective = hs::parse_batch_objective(tune.objective);
  } catch (const c10::Error& e) {
    throw FlagError(std::string("--") + e.what_without_backtrace());
  }
  if (tune.steps < 1) throw FlagError("--steps: expected an integer >= 1, got " + std::to_string(tune.steps));
  const hs::Placement placement = dcgan_placement(config);
  const int64_t dataset_size = load_training_data(config).images.size(0);
  options.start = config.batch_size;
  options.multiple = placement.global_replicas();
  options.limit = tune.max_batch > 0 ? tune.max_batch : dataset_size;
  if (!(tune.memory_resolution >= 0 && tune.memory_resolution < 1))
    throw FlagError("--memory-resolution: expected a fraction in [0, 1), got " + format_number(tune.memory_resolution));
  options.memory_resolution = tune.memory_resolution;
  if (options.start % options.multiple != 0)
    throw FlagError("--batch-size " + std::to_string(options.start) + " does not split evenly over the " +
                    std::to_string(options.multiple) + " replicas");
  out << "tune: " << hs::to_string(options.objective) << " from batch " << options.start << " on "
      << placement.to_string() << "; " << tune.steps << " timed steps per batch at most"
      << (tune.timed_seconds > 0 && tune.steps > 3 ? " (fewer, 3 at least: as many as fill " + format_number(tune.timed_seconds) + " s at the first 3 steps' pace)" : "")
      << ", epochs of " << dataset_size << " images\n";
  auto fixed = [](double value, int digits) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(digits) << value;
    return os.str();
  };
  // The trials' trainers share their process groups: a data-parallel trial otherwise spends most of its time
  // setting up and aborting NCCL communicators (docs/batch_size.md).
  const auto process_groups = std::make_shared<hs::ProcessGroupCache>();
  auto probe = [&](int64_t batch) {
    auto trial = measure_dcgan_steps(config, batch, dataset_size, tune.steps, tune.timed_seconds, process_groups);
    const double timed = trial.step_seconds * static_cast<double>(trial.timed_steps);
    out << "  batch " << batch << ": "
        << (trial.fits ? format_number(trial.epoch_seconds) + " s/epoch over " + std::to_string(trial.timed_steps) +
                             " steps; trial " + fixed(trial.trial_seconds, 3) + " s: building " +
                             fixed(trial.build_seconds, 3) + ", warm-up " +
                             fixed(trial.setup_seconds - trial.build_seconds, 3) + ", timed " + fixed(timed, 3) +
                             ", releasing " + fixed(trial.trial_seconds - trial.setup_seconds - timed, 3) +
                             (trial.note.empty() ? "" : " (" + trial.note + ")")
                       : trial.note)
        << std::endl;
    return trial;
  };
  if (!cuda_devices_of(placement).empty()) {
    // What any run pays once, searching or not: CUDA's context, the libraries' handles, each kernel's first load.
    const auto start = measure_dcgan_steps(config, options.start, dataset_size, 0, 0, process_groups);
    out << "start: " << fixed(start.trial_seconds, 2) << " s for CUDA's context, the libraries' handles and the "
        << "kernels' first use (the warm-up of batch " << options.start << ", untimed; a run pays it once, "
        << "searching or not: not counted in the search's cost)" << (start.fits ? "" : ": " + start.note) << "\n";
  }
  hs::BatchSearchResult result;
  const auto began = std::chrono::steady_clock::now();
  try {
    result = hs::search_batch_size(probe, options);
  } catch (const c10::Error& e) {
    throw Error(std::string("tune: ") + e.what_without_backtrace());
  }
  const double search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  out << result.table() << "chose batch " << result.chosen << ": " << result.reason << "\n"
      << "note: a GAN's batch size also changes what it learns (and the learning rate that suits it); this is a "
         "speed choice, and --batch-size stays what you give it\n";
  const auto chosen = std::find_if(result.trials.begin(), result.trials.end(),
                                   [&](const hs::BatchTrial& t) { return t.batch == result.chosen && t.fits; });
  if (chosen != result.trials.end() && chosen->epoch_seconds > 0) {
    const double run_seconds = 20 * chosen->epoch_seconds;
    out << "search: " << result.trials.size() << " trials in " << fixed(search_seconds, 2) << " s, "
        << fixed(100 * search_seconds / run_seconds, 1) << "% of a 20-epoch run at batch " << result.chosen << " ("
        << fixed(run_seconds, 2) << " s)\n";
  }

  // The sweep: batches evenly spaced over what the search ran, each measured as the search's trials were.
  std::vector<hs::BatchTrial> swept;
  int64_t top = options.start;
  for (const auto& t : result.trials) {
    if (t.fits) top = std::max(top, t.batch);
  }
  std::vector<int64_t> sweep_batches;
  for (int64_t k = 0; k < tune.sweep; ++k) {
    const double at = tune.sweep == 1 ? 1.0 : static_cast<double>(k) / static_cast<double>(tune.sweep - 1);
    const int64_t raw = options.start + std::llround(at * static_cast<double>(top - options.start));
    const int64_t batch = std::max(options.multiple, raw / options.multiple * options.multiple);
    if (std::find(sweep_batches.begin(), sweep_batches.end(), batch) == sweep_batches.end()) sweep_batches.push_back(batch);
  }
  if (!sweep_batches.empty()) out << "sweep: " << sweep_batches.size() << " batches from " << options.start << " to " << top << "\n";
  for (int64_t batch : sweep_batches) swept.push_back(probe(batch));
  const auto best = std::min_element(swept.begin(), swept.end(), [](const hs::BatchTrial& a, const hs::BatchTrial& b) {
    return a.fits != b.fits ? a.fits : a.epoch_seconds < b.epoch_seconds;
  });
  if (best != swept.end() && best->fits && chosen != result.trials.end()) {
    out << "chosen batch " << result.chosen << ": " << format_number(chosen->epoch_seconds) << " s/epoch, "
        << fixed(100 * (chosen->epoch_seconds / best->epoch_seconds - 1), 1) << "% from the sweep's best (batch "
        << best->batch << ": " << format_number(best->epoch_seconds) << " s/epoch)\n";
  }

  std::vector<BarGroup> groups;
  auto add = [&](const hs::BatchTrial& t, size_t series) {
    if (!t.fits) return;
    bar_group(groups, std::to_string(t.batch), swept.empty() ? 1 : 2).values[series] = t.epoch_seconds;
  };
  for (const auto& t : result.trials) add(t, 0);
  for (const auto& t : swept) add(t, 1);
  std::sort(groups.begin(), groups.end(), [](const BarGroup& a, const BarGroup& b) {
    return std::stoll(a.label) < std::stoll(b.label);
  });
  std::vector<PlotSeries> series{{"search: seconds per epoch", {}, {31, 119, 180}}};
  if (!swept.empty()) series.push_back({"sweep: seconds per epoch", {}, {253, 141, 60}});
  require_writable_folder("--out", config.out);
  const std::string png = config.out + "/tune.png";
  write_bar_chart(groups, series, "seconds per epoch (x: global batch)", png);
  out << "chart: " << png << "\n";
  return result;
}

}  // namespace hierpar::examples
