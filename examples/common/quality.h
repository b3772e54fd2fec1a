// A sample-quality metric for generators of Fashion-MNIST, with no downloaded weights: the Frechet distance
// between generated and real test images in the feature space of the seed CNN (its 100 ReLU features before the
// class logits) trained on Fashion-MNIST's training set, and the classifier's class coverage of the samples.
// Comparable between hierpar runs of the same image size; not comparable with published (Inception) FIDs.
#pragma once

#include "hierpar/models/cnn.h"
#include "hierpar/models/dcgan.h"

#include <array>
#include <ostream>
#include <string>
#include <vector>

namespace hierpar::examples {

// The trained classifier: loaded from `cache` when it is there, otherwise trained (10 epochs, batch 128, Adam
// 1e-3, seed 0, about 25 s on two CPU cores), checked to reach at least 90% test accuracy and saved to `cache`
// (atomically). Progress goes to `log`. Returns it in eval mode on the CPU.
models::SeedCNN fashion_mnist_classifier(const std::string& fashion_mnist_dir, const std::string& cache,
                                         std::ostream& log);
std::string default_classifier_cache();  // $XDG_CACHE_HOME or ~/.cache, then hierpar/fashion-mnist-classifier.pt

// Images in [-1, 1], [N, 1, H, W], as a generator of size H makes them -> [N, 100] float64 features. Real images
// go through the same path: quantised to 8 bits, resized to 28x28 (antialiased), normalised as the CNN trained.
torch::Tensor classifier_features(models::SeedCNNImpl& classifier, const torch::Tensor& images);

// The Frechet distance between Gaussians fitted to two feature sets [N, D] (float64; N > 1).
double frechet_distance(const torch::Tensor& a, const torch::Tensor& b);

struct SampleQuality {
  double fid = 0;                        // against the real test images, in the classifier's features
  std::array<double, 10> class_share{};  // the share of samples the classifier puts in each class
  int covered_classes = 0;               // classes with at least 5% of the samples (10: all)
  std::string to_string() const;         // one line
};

// The features of Fashion-MNIST's 10000 test images prepared at `image_size` (what samples are compared with).
torch::Tensor real_test_features(models::SeedCNNImpl& classifier, const std::string& fashion_mnist_dir,
                                 int64_t image_size);

// `count` samples of `generator` (eval mode for the call; noise from `seed`) against `real` features.
SampleQuality generator_quality(models::GeneratorImpl& generator, models::SeedCNNImpl& classifier,
                                const torch::Tensor& real, int64_t count, uint64_t seed);

// The same against Fashion-MNIST's test set prepared at the generator's image size.
SampleQuality evaluate_generator(models::GeneratorImpl& generator, models::SeedCNNImpl& classifier,
                                 const std::string& fashion_mnist_dir, int64_t count, uint64_t seed);

// <out>/quality.csv (step, epoch, fid, classes_covered) and <out>/quality.png (FID per evaluation), kept across
// resumes: rows after the step a run resumes from are dropped first.
class QualityLog {
 public:
  QualityLog(std::string out, int64_t resumed_at_step);
  void add(int64_t step, int64_t epoch, const SampleQuality& quality);  // rewrites both files (atomically)

 private:
  std::string out_;
  std::vector<std::string> rows_;
  std::vector<double> fids_;
};

// Plots the FID of several runs (LABEL, path of a quality.csv) on one PNG, one line per run against the evaluation
// number; returns a line per run (evaluations, last and best FID with its epoch).
std::vector<std::string> plot_quality_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                           const std::string& output);

// The same figures for real images (uint8 [N, 1, H, W], prepared at `image_size`) in place of samples, against
// `real` features (real_test_features at that size): the scale of a good score (Fashion-MNIST's training set
// against its test set comes near 0).
SampleQuality evaluate_images(const torch::Tensor& images, int64_t image_size, models::SeedCNNImpl& classifier,
                              const torch::Tensor& real);

}  // namespace hierpar::examples
