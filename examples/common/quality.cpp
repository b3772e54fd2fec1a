#include "common/quality.h"

#include "common/cli.h"
#include "common/data.h"
#include "common/images.h"

#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kEpochs = 10, kBatch = 128;
constexpr double kRequiredAccuracy = 0.90;

double test_accuracy(models::SeedCNNImpl& model, const Dataset& test) {
  torch::NoGradGuard no_grad;
  const auto x = normalise(test.images);
  int64_t correct = 0;
  for (int64_t i = 0; i < x.size(0); i += 1000) {
    correct += (model.forward(x.slice(0, i, i + 1000)).argmax(1) == test.labels.slice(0, i, i + 1000))
                   .sum()
                   .item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(x.size(0));
}

models::SeedCNN train_classifier(const std::string& dir, std::ostream& log) {
  const Dataset train = load_fashion_mnist(dir, /*train=*/true), test = load_fashion_mnist(dir, /*train=*/false);
  torch::manual_seed(0);
  models::SeedCNN model(LayerSet::stock);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto x = normalise(train.images);
  const int64_t n = x.size(0), steps = n / kBatch;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    model->train();
    const auto order = at::randperm(n, at::make_generator<at::CPUGeneratorImpl>(1000 + epoch), torch::kLong);
    for (int64_t s = 0; s < steps; ++s) {
      const auto index = order.slice(0, s * kBatch, (s + 1) * kBatch);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.index_select(0, index)), train.labels.index_select(0, index))
          .backward();
      optimizer.step();
    }
    model->eval();
    char line[96];
    std::snprintf(line, sizeof line, "classifier: epoch %lld/%lld, test accuracy %.2f%%\n",
                  static_cast<long long>(epoch + 1), static_cast<long long>(kEpochs), 100 * test_accuracy(*model, test));
    log << line << std::flush;
  }
  return model;
}

// Holds an exclusive lock on `path` (created if missing) while it lives, so that programs started together (a test
// suite's processes, two runs) train the classifier once: the others wait, then load what the first saved.
class FileLock {
 public:
  explicit FileLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0) ::flock(fd_, LOCK_EX);  // without a lock file (read-only folder) each program trains its own
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

}  // namespace

std::string default_classifier_cache() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::string base = xdg != nullptr && *xdg ? xdg : std::string(home != nullptr ? home : ".") + "/.cache";
  return base + "/hierpar/fashion-mnist-classifier.pt";
}

models::SeedCNN fashion_mnist_classifier(const std::string& fashion_mnist_dir, const std::string& cache,
                                         std::ostream& log) {
  models::SeedCNN model(LayerSet::stock);
  std::error_code ignored;
  fs::create_directories(fs::path(cache).parent_path(), ignored);
  const FileLock lock(cache + ".lock");
  if (fs::exists(cache)) {
    try {
      torch::load(model, cache);
    } catch (const c10::Error& e) {
      throw Error(cache + ": not a classifier hierpar saved (delete it to train a new one)");
    }
  } else {
    log << "classifier: training the seed CNN on Fashion-MNIST for the quality metric (once; cached in " << cache
        << ")\n";
    model = train_classifier(fashion_mnist_dir, log);
    const double accuracy = test_accuracy(*model, load_fashion_mnist(fashion_mnist_dir, /*train=*/false));
    if (accuracy < kRequiredAccuracy)
      throw Error("the quality classifier reached " + format_number(100 * accuracy) + "% test accuracy, below 90%");
    fs::create_directories(fs::path(cache).parent_path());
    const std::string tmp = cache + ".tmp" + std::to_string(::getpid());
    torch::save(model, tmp);
    fs::rename(tmp, cache);
  }
  model->eval();
  return model;
}

torch::Tensor classifier_features(models::SeedCNNImpl& classifier, const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1, "classifier_features: expected [N, 1, H, W] images, got ",
              images.sizes());
  torch::NoGradGuard no_grad;
  const auto bytes = images.detach().to(torch::kCPU, torch::kFloat).add(1).mul(127.5).round().clamp(0, 255).to(torch::kUInt8);
  std::vector<torch::Tensor> features;
  for (int64_t i = 0; i < bytes.size(0); i += 1000) {
    features.push_back(classifier.features(normalise(prepare_images(bytes.slice(0, i, i + 1000), 28, 1))));
  }
  return torch::cat(features).to(torch::kDouble);
}

double frechet_distance(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1) && a.size(0) > 1 && b.size(0) > 1,
              "frechet_distance: expected two [N, D] feature sets with N > 1, got ", a.sizes(), " and ", b.sizes());
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  const auto mu_x = x.mean(0), mu_y = y.mean(0);
  const auto cov_x = torch::cov(x.t()), cov_y = torch::cov(y.t());
  // tr(sqrt(cov_x cov_y)) = tr(sqrt(S cov_y S)) with S = sqrt(cov_x): a symmetric matrix, so eigh serves.
  auto [values_x, vectors_x] = torch::linalg_eigh(cov_x);
  const auto sqrt_x = vectors_x.matmul(torch::diag(values_x.clamp_min(0).sqrt())).matmul(vectors_x.t());
  const auto middle = sqrt_x.matmul(cov_y).matmul(sqrt_x);
  const auto cross = torch::linalg_eigvalsh(0.5 * (middle + middle.t())).clamp_min(0).sqrt().sum();
  return ((mu_x - mu_y).pow(2).sum() + cov_x.trace() + cov_y.trace() - 2 * cross).item<double>();
}

std::string SampleQuality::to_string() const {
  std::ostringstream os;
  char fid_text[32];
  std::snprintf(fid_text, sizeof fid_text, "%.2f", fid);
  os << "FID (seed-CNN features) " << fid_text << ", classes covered " << covered_classes << "/10, shares";
  for (double share : class_share) {
    char text[16];
    std::snprintf(text, sizeof text, " %.2f", share);
    os << text;
  }
  return os.str();
}

torch::Tensor real_test_features(models::SeedCNNImpl& classifier, const std::string& dir, int64_t image_size) {
  const Dataset test = load_fashion_mnist(dir, /*train=*/false);
  return classifier_features(classifier, normalise(prepare_images(test.images, image_size, 1)));
}

namespace {

SampleQuality quality_of(models::SeedCNNImpl& classifier, const torch::Tensor& images, const torch::Tensor& real) {
  SampleQuality q;
  const auto features = classifier_features(classifier, images);
  q.fid = frechet_distance(features, real);
  torch::NoGradGuard no_grad;
  const auto classes = classifier.fc2->forward(features.to(torch::kFloat)).argmax(1);
  const auto counts = torch::bincount(classes, {}, 10).to(torch::kDouble) / static_cast<double>(classes.size(0));
  for (int k = 0; k < 10; ++k) {
    q.class_share[k] = counts[k].item<double>();
    q.covered_classes += q.class_share[k] >= 0.05;
  }
  return q;
}

}  // namespace

SampleQuality generator_quality(models::GeneratorImpl& generator, models::SeedCNNImpl& classifier,
                                const torch::Tensor& real, int64_t count, uint64_t seed) {
  if (generator.options.channels != 1) throw Error("the quality metric is for one-channel (Fashion-MNIST) generators");
  torch::NoGradGuard no_grad;
  const bool was_training = generator.is_training();
  generator.eval();
  const auto device = generator.parameters().front().device();
  std::vector<torch::Tensor> samples;
  auto noise = torch::randn({count, generator.options.nz}, at::make_generator<at::CPUGeneratorImpl>(seed));
  for (int64_t i = 0; i < count; i += 500) samples.push_back(generator.forward(noise.slice(0, i, i + 500).to(device)).cpu());
  generator.train(was_training);
  return quality_of(classifier, torch::cat(samples), real);
}

SampleQuality evaluate_generator(models::GeneratorImpl& generator, models::SeedCNNImpl& classifier,
                                 const std::string& fashion_mnist_dir, int64_t count, uint64_t seed) {
  return generator_quality(generator, classifier,
                           real_test_features(classifier, fashion_mnist_dir, generator.options.image_size), count, seed);
}

QualityLog::QualityLog(std::string out, int64_t resumed_at_step) : out_(std::move(out)) {
  std::ifstream in(out_ + "/quality.csv");
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    long long step = 0;
    double epoch = 0, fid = 0;
    if (std::sscanf(line.c_str(), "%lld,%lf,%lf", &step, &epoch, &fid) != 3 || step > resumed_at_step) continue;
    rows_.push_back(line);
    fids_.push_back(fid);
  }
}

void QualityLog::add(int64_t step, int64_t epoch, const SampleQuality& quality) {
  char row[96];
  std::snprintf(row, sizeof row, "%lld,%lld,%.4f,%d", static_cast<long long>(step), static_cast<long long>(epoch),
                quality.fid, quality.covered_classes);
  rows_.push_back(row);
  fids_.push_back(quality.fid);
  const std::string csv = out_ + "/quality.csv", tmp = csv + ".tmp";
  {
    std::ofstream f(tmp);
    f << "step,epoch,fid,classes_covered\n";
    for (const auto& r : rows_) f << r << "\n";
    if (!f) throw Error(tmp + ": cannot write");
  }
  fs::rename(tmp, csv);
  write_line_plot({{"FID (seed-CNN features)", fids_, {214, 39, 40}}}, "evaluation (every --eval-every steps)",
                  out_ + "/quality.png", 720, 420, "FID");
}

std::vector<std::string> plot_quality_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                           const std::string& output) {
  auto add = [](size_t i, const std::string& label, const std::string& path, std::vector<PlotSeries>& series) {
    std::ifstream in(path);
    if (!in) throw Error(path + ": cannot read (expected a quality.csv written by train --eval-every)");
    std::string line;
    std::getline(in, line);
    if (line.rfind("step,epoch,fid", 0) != 0) throw Error(path + ": not a quality.csv (its header is '" + line + "')");
    std::vector<double> fids;
    double best = 0, best_epoch = 0;
    while (std::getline(in, line)) {
      long long step = 0;
      double epoch = 0, fid = 0;
      if (std::sscanf(line.c_str(), "%lld,%lf,%lf", &step, &epoch, &fid) != 3)
        throw Error(path + ": row " + std::to_string(fids.size() + 2) + " is not step,epoch,fid,...: '" + line + "'");
      if (fids.empty() || fid < best) best = fid, best_epoch = epoch;
      fids.push_back(fid);
    }
    if (fids.empty()) throw Error(path + ": no evaluations in it");
    std::ostringstream text;
    text << label << ": " << fids.size() << " evaluations; last FID " << std::fixed << std::setprecision(2)
         << fids.back() << ", best " << best << " (epoch " << std::setprecision(0) << best_epoch << ")";
    series.push_back({label, std::move(fids), run_colour(i)});
    return text.str();
  };
  return plot_runs(runs, add, "evaluation (every --eval-every steps)", "FID (seed-CNN features)", output);
}

SampleQuality evaluate_images(const torch::Tensor& images, int64_t image_size, models::SeedCNNImpl& classifier,
                              const torch::Tensor& real) {
  return quality_of(classifier, normalise(prepare_images(images, image_size, 1)), real);
}

}  // namespace hierpar::examples
