// hierpar-cnn: the seed CNN (003) on Fashion-MNIST with stock or hierpar layers; prints test accuracy
// and seconds per epoch.
#include "common/cli.h"
#include "common/data.h"
#include "common/shared_flags.h"
#include "hierpar/models/cnn.h"

#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cstdio>
#include <iostream>

using namespace hierpar::examples;

namespace {

int run(int argc, char** argv) {
  std::string layers = "hierpar", device_name, dir = default_fashion_mnist_dir();
  int64_t batch_size = 128, epochs = 3, seed = 0, limit = 0;
  double lr = 1e-3;
  Flags flags("hierpar-cnn");
  flags.add("layers", &layers, "stock (torch::nn) or hierpar")
      .add("batch-size", &batch_size, "images per step (the seed's: 8 and 128)", 1)
      .add("epochs", &epochs, "epochs to train", 1)
      .add("lr", &lr, "Adam learning rate", 0.0)
      .add("seed", &seed, "seed of weights and data order", 0)
      .add("limit", &limit, "use at most this many training images (0: all 60000)", 0)
      .add("fashion-mnist-dir", &dir, "where the Fashion-MNIST .gz files are")
      .add("device", &device_name, "cpu, cuda or cuda:N (default: cuda when available)");
  if (!flags.parse(argc, argv, 1)) return 0;
  const auto set = parse_layers(layers);
  const auto device = parse_device(device_name);

  auto train = load_fashion_mnist(dir, true, limit), test = load_fashion_mnist(dir, false);
  torch::manual_seed(static_cast<uint64_t>(seed));
  hierpar::models::SeedCNN model(set);
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(lr));
  std::cerr << "data: " << train.description << "; model: seed CNN, layers " << layers << ", device " << device.str() << ", batch " << batch_size << "\n";

  // Both sets live on the device for the whole run (60000 x 28 x 28 bytes).
  auto train_x = train.images.to(device), train_y = train.labels.to(device);
  auto test_x = normalise(test.images.to(device)), test_y = test.labels.to(device);
  const int64_t n = train_x.size(0), steps = n / batch_size;
  if (steps == 0) throw Error("the training set has fewer images than one batch of " + std::to_string(batch_size));
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed) * 1000003ull + epoch);
    auto order = at::randperm(n, gen, torch::kLong).to(device);
    Progress progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs), steps, batch_size);
    model->train();
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor loss;
    for (int64_t s = 0; s < steps; ++s) {
      auto index = order.slice(0, s * batch_size, (s + 1) * batch_size);
      optimizer.zero_grad();
      loss = torch::nn::functional::cross_entropy(model->forward(normalise(train_x.index_select(0, index))),
                                                  train_y.index_select(0, index));
      loss.backward();
      optimizer.step();
      if ((s + 1) % 200 == 0 || s + 1 == steps) progress.update(s + 1, {{"loss", loss.item<double>()}});
    }
    progress.finish();
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    model->eval();
    torch::NoGradGuard no_grad;
    int64_t correct = 0;
    for (int64_t i = 0; i < test_x.size(0); i += 1000) {
      auto logits = model->forward(test_x.slice(0, i, i + 1000));
      correct += (logits.argmax(1) == test_y.slice(0, i, i + 1000)).sum().item<int64_t>();
    }
    std::printf("epoch %lld: %.2f s per epoch (%lld steps, batch %lld), test accuracy %.2f%%\n",
                static_cast<long long>(epoch + 1), seconds, static_cast<long long>(steps),
                static_cast<long long>(batch_size), 100.0 * correct / test_x.size(0));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run_reporting_errors("hierpar-cnn", [&] { return run(argc, argv); }); }
