#include "common/loss_log.h"

#include "common/cli.h"
#include "common/images.h"

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace hierpar::examples {
namespace fs = std::filesystem;

void write_losses(const std::string& out, const torch::Tensor& history, int64_t batches_per_epoch) {
  const std::string csv = out + "/losses.csv", tmp = csv + ".tmp";
  {
    std::ofstream f(tmp);
    f << "step,epoch,loss_d_real,loss_d_fake,loss_g\n";
    auto h = history.accessor<float, 2>();
    for (int64_t i = 0; i < history.size(0); ++i) {
      f << i + 1 << "," << i / batches_per_epoch + 1 << "," << h[i][0] << "," << h[i][1] << "," << h[i][2] << "\n";
    }
    if (!f) throw Error(tmp + ": cannot write");
  }
  fs::rename(tmp, csv);
  std::vector<PlotSeries> series{{"D loss (real)", {}, {31, 119, 180}},
                                 {"D loss (fake)", {}, {255, 127, 14}},
                                 {"G loss", {}, {44, 160, 44}}};
  for (int64_t i = 0; i < history.size(0); ++i)
    for (int k = 0; k < 3; ++k) series[k].values.push_back(history[i][k].item<double>());
  write_line_plot(series, "step", out + "/loss.png", 720, 420, "loss");
}

namespace {

// losses.csv as written by write_losses: the D loss (real + fake) and G loss per step.
std::pair<std::vector<double>, std::vector<double>> read_losses_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot read the losses (expected a losses.csv written by hierpar-dcgan train)");
  std::string line;
  std::getline(in, line);
  if (line != "step,epoch,loss_d_real,loss_d_fake,loss_g")
    throw Error(path + ": not a hierpar-dcgan losses.csv (header '" + line + "')");
  std::vector<double> d, g;
  while (std::getline(in, line)) {
    double step, epoch, real, fake, gen;
    if (std::sscanf(line.c_str(), "%lf,%lf,%lf,%lf,%lf", &step, &epoch, &real, &fake, &gen) != 5)
      throw Error(path + ": line " + std::to_string(d.size() + 2) + " is not 5 numbers: '" + line + "'");
    d.push_back(real + fake);
    g.push_back(gen);
  }
  if (d.empty()) throw Error(path + ": no steps");
  return {d, g};
}

}  // namespace

std::vector<std::string> plot_loss_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                        const std::string& output) {
  auto add = [](size_t i, const std::string& label, const std::string& path, std::vector<PlotSeries>& series) {
    auto [d, g] = read_losses_csv(path);
    const auto dark = run_colour(i);
    const std::array<uint8_t, 3> light{static_cast<uint8_t>((dark[0] + 255) / 2), static_cast<uint8_t>((dark[1] + 255) / 2),
                                       static_cast<uint8_t>((dark[2] + 255) / 2)};
    const size_t from = d.size() - (d.size() + 3) / 4;
    auto mean_from = [&](const std::vector<double>& v) {
      double sum = 0;
      for (size_t k = from; k < v.size(); ++k) sum += v[k];
      return sum / static_cast<double>(v.size() - from);
    };
    std::ostringstream line;
    line << label << ": " << d.size() << " steps; mean over steps " << from + 1 << "-" << d.size() << ": D loss "
         << std::fixed << std::setprecision(4) << mean_from(d) << ", G loss " << mean_from(g);
    series.push_back({label + " D loss", std::move(d), dark});
    series.push_back({label + " G loss", std::move(g), light});
    return line.str();
  };
  return plot_runs(runs, add, "step", "loss", output);
}

}  // namespace hierpar::examples
