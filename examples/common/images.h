// PNG output of the examples: image grids and loss-curve plots.
#pragma once

#include <torch/types.h>

#include <array>
#include <functional>
#include <cstdint>
#include <string>
#include <vector>

namespace hierpar::examples {

// Writes float images [N, C, H, W] (C = 1 or 3) with values in [-1, 1] as one PNG: a grid of `columns`
// (0: ceil(sqrt(N))) with a 2-pixel border. Creates missing parent folders. Throws Error on failure.
// Grids narrower than kMinGridWidth pixels are enlarged by the smallest whole factor that reaches it.
constexpr int64_t kMinGridWidth = 512;
void write_image_grid(const torch::Tensor& images, const std::string& path, int64_t columns = 0);

struct PlotSeries {
  std::string name;
  std::vector<double> values;  // y at x = 1, 2, ...
  std::array<uint8_t, 3> rgb;
};

// The colour of the i-th of several runs in a plot (a ten-colour palette, repeating).
std::array<uint8_t, 3> run_colour(size_t i);

// Several runs on one line plot (900 x 480): `add(i, label, path, series)` appends run i's series and returns its
// line for the caller to print. Throws Error when `runs` is empty.
using RunSeriesReader = std::function<std::string(size_t index, const std::string& label, const std::string& path,
                                                  std::vector<PlotSeries>& series)>;
std::vector<std::string> plot_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                   const RunSeriesReader& add, const std::string& x_label, const std::string& y_label,
                                   const std::string& output);

// Round tick values for an axis covering [lo, hi]: the multiples of one step of 1, 2 or 5 x 10^k, at most
// `max_ticks` of them, from the last multiple at or below lo to the first at or above hi (so an axis drawn from the
// first tick to the last holds the data and starts at 0 for data that does).
std::vector<double> round_ticks(double lo, double hi, int max_ticks = 6);

// A line plot of the series against their index, with axes on round ticks from the data's own range, tick labels,
// axis labels and a legend, as a PNG.
// Series longer than the plot is wide are averaged per pixel column.
void write_line_plot(const std::vector<PlotSeries>& series, const std::string& x_label, const std::string& path,
                     int width = 720, int height = 420, const std::string& y_label = "");

// A grouped bar chart as a PNG: one group per entry of `groups` (labelled under the axis), one bar per
// series in each group (values[i] belongs to series i; NaN leaves a gap), value printed above each bar,
// y from 0, legend top right.
struct BarGroup {
  std::string label;
  std::vector<double> values;
};
void write_bar_chart(const std::vector<BarGroup>& groups, const std::vector<PlotSeries>& series,
                     const std::string& y_label, const std::string& path, int width = 900, int height = 420);

// The group labelled `label`, appended to `groups` with `series` NaN values (gaps) when there is none yet. The
// reference holds until `groups` grows again.
BarGroup& bar_group(std::vector<BarGroup>& groups, const std::string& label, size_t series);

}  // namespace hierpar::examples
