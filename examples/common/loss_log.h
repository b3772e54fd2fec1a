// The losses of a DCGAN run: losses.csv and loss.png in its output folder, and plots comparing several runs.
#pragma once

#include <torch/types.h>

#include <string>
#include <utility>
#include <vector>

namespace hierpar::examples {

// Writes <out>/losses.csv (step, epoch and the three losses per step; atomically) and <out>/loss.png from
// `history` ([steps, 3]: D loss on real, D loss on fakes, G loss).
void write_losses(const std::string& out, const torch::Tensor& history, int64_t batches_per_epoch);

// Plots the D loss (real + fake) and G loss of several runs' losses.csv files on one PNG; `runs` are
// (label, csv path). Returns one summary line per run (mean losses over the last quarter of the steps).
std::vector<std::string> plot_loss_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                        const std::string& output);

}  // namespace hierpar::examples
