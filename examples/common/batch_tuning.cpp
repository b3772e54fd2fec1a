#include "common/batch_tuning.h"

#include "common/cli.h"
#include "common/images.h"
#include "hierpar/strategy/adversarial_trainer.h"
#include "hierpar/strategy/gpu_utilization.h"

#include <torch/cuda.h>

#ifdef HIERPAR_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cmath>
#include <memory>
#include <set>

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

hs::BatchTrial measure_dcgan_steps(const DCGANTrainConfig& config, int64_t batch, int64_t dataset_size,
                                   int64_t steps) {
  const hs::Placement placement = dcgan_placement(config);
  if (placement.launch.multi_process()) throw FlagError("tune runs in one process: start it without torchrun");
  const StepSettings step = step_settings(config, placement.replicas[0].discriminator.type());
  hs::AdversarialOptions options = trainer_options(config, step);
  options.loss_log_steps = steps + options.graph_warmup_steps + 4;  // no loss read-back inside the timed steps
  options.report_failures = false;
  const auto devices = cuda_devices_of(placement);
  const torch::Device data_device = placement.replicas[0].discriminator;

  hs::BatchTrial trial;
  trial.batch = batch;
  std::unique_ptr<hs::AdversarialTrainer> trainer;
  const hs::PrecisionScope precision(step.precision);  // the trials compute as the run they stand for will
  try {
    torch::manual_seed(static_cast<uint64_t>(config.seed));
    models::Generator generator(config.model);
    models::Discriminator discriminator(config.model);
    trainer = std::make_unique<hs::AdversarialTrainer>(torch::nn::AnyModule(generator),
                                                       torch::nn::AnyModule(discriminator), placement, options);
    const int64_t size = config.model.image_size;
    const torch::Tensor real =
        torch::rand({batch, config.model.channels, size, size}, at::make_generator<at::CPUGeneratorImpl>(1))
            .mul_(2)
            .sub_(1)
            .to(data_device);
    // Warm-up: the first steps, and with CUDA graphs the capture, are not what a run's steps cost.
    for (int64_t i = 0; i < options.graph_warmup_steps + 2; ++i) trainer->step(real);
    synchronize_devices(placement);
#ifdef HIERPAR_WITH_CUDA
    for (const auto& d : devices) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
    hs::UtilizationSampler sampler(data_device, std::chrono::milliseconds(20));
    const auto begin = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < steps; ++i) trainer->step(real);
    synchronize_devices(placement);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    trial.gpu_usage = hs::top_half_mean(sampler.stop());
    trial.fits = true;
    trial.step_seconds = seconds / static_cast<double>(steps);
    trial.epoch_seconds = trial.step_seconds * std::ceil(static_cast<double>(dataset_size) / static_cast<double>(batch));
    trial.images_per_second = static_cast<double>(batch) / trial.step_seconds;
#ifdef HIERPAR_WITH_CUDA
    for (const auto& d : devices) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
      trial.peak_bytes = std::max<int64_t>(trial.peak_bytes, stats.allocated_bytes[0].peak);
    }
#endif
  } catch (const c10::OutOfMemoryError& e) {
    trial.fits = false;
    trial.note = "out of memory";
  }
  trainer.reset();
#ifdef HIERPAR_WITH_CUDA
  if (!devices.empty()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
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
  if (options.start % options.multiple != 0)
    throw FlagError("--batch-size " + std::to_string(options.start) + " does not split evenly over the " +
                    std::to_string(options.multiple) + " replicas");
  out << "tune: " << hs::to_string(options.objective) << " from batch " << options.start << " on "
      << placement.to_string() << "; " << tune.steps << " timed steps per batch, epochs of " << dataset_size
      << " images\n";
  hs::BatchSearchResult result;
  try {
    result = hs::search_batch_size(
        [&](int64_t batch) {
          auto trial = measure_dcgan_steps(config, batch, dataset_size, tune.steps);
          out << "  batch " << batch << ": "
              << (trial.fits ? format_number(trial.epoch_seconds) + " s/epoch" : trial.note) << std::endl;
          return trial;
        },
        options);
  } catch (const c10::Error& e) {
    throw Error(std::string("tune: ") + e.what_without_backtrace());
  }
  out << result.table() << "chose batch " << result.chosen << ": " << result.reason << "\n"
      << "note: a GAN's batch size also changes what it learns (and the learning rate that suits it); this is a "
         "speed choice, and --batch-size stays what you give it\n";
  std::vector<BarGroup> groups;
  for (const auto& t : result.trials) {
    if (t.fits) groups.push_back({std::to_string(t.batch), {t.epoch_seconds}});
  }
  const PlotSeries epoch{"seconds per epoch", {}, {31, 119, 180}};
  require_writable_folder("--out", config.out);
  const std::string png = config.out + "/tune.png";
  write_bar_chart(groups, {epoch}, "seconds per epoch (x: global batch)", png);
  out << "chart: " << png << "\n";
  return result;
}

}  // namespace hierpar::examples
