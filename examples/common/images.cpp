#include "common/images.h"

#include "common/cli.h"

#include <ATen/ATen.h>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb/stb_image_write.h>
#include <stb/stb_easy_font.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace hierpar::examples {
namespace {

void make_parent(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
}

void write_png(const std::string& path, int width, int height, int channels, const uint8_t* pixels) {
  make_parent(path);
  if (!stbi_write_png(path.c_str(), width, height, channels, pixels, width * channels))
    throw Error(path + ": cannot write PNG");
}

// An RGB raster with the few drawing primitives a plot needs.
struct Canvas {
  int width, height;
  std::vector<uint8_t> rgb;
  Canvas(int w, int h) : width(w), height(h), rgb(static_cast<size_t>(w) * h * 3, 255) {}

  void pixel(int x, int y, const std::array<uint8_t, 3>& c) {
    if (x < 0 || y < 0 || x >= width || y >= height) return;
    std::copy(c.begin(), c.end(), rgb.begin() + (static_cast<size_t>(y) * width + x) * 3);
  }
  void rect(int x0, int y0, int x1, int y1, const std::array<uint8_t, 3>& c) {
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) pixel(x, y, c);
  }
  // A line of thickness 2 by stepping along its longer axis.
  void line(double x0, double y0, double x1, double y1, const std::array<uint8_t, 3>& c) {
    const int steps = static_cast<int>(std::ceil(std::max(std::abs(x1 - x0), std::abs(y1 - y0)))) + 1;
    for (int i = 0; i <= steps; ++i) {
      const double t = static_cast<double>(i) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0))), y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      pixel(x, y, c);
      pixel(x + 1, y, c);
      pixel(x, y + 1, c);
    }
  }
  // stb_easy_font emits quads (4 vertices of x, y, z floats and 4 colour bytes); they are axis-aligned.
  void text(int x, int y, const std::string& s, const std::array<uint8_t, 3>& c) {
    static char buffer[64000];
    const int quads = stb_easy_font_print(static_cast<float>(x), static_cast<float>(y), const_cast<char*>(s.c_str()),
                                          nullptr, buffer, sizeof buffer);
    for (int q = 0; q < quads; ++q) {
      const float* v = reinterpret_cast<const float*>(buffer + q * 64);
      rect(static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[8]), static_cast<int>(v[9]), c);
    }
  }
  static int text_width(const std::string& s) { return stb_easy_font_width(const_cast<char*>(s.c_str())); }
};

std::string format_tick(double v) {
  char buf[32];
  if (std::abs(v) < 1e-12) v = 0;  // a multiple of the step that rounding left a hair away from 0
  std::snprintf(buf, sizeof buf, std::abs(v) >= 1000 ? "%.0f" : "%.4g", v);
  return buf;
}

// Horizontal grid lines at `ticks` (to_y: a value's pixel row), each labelled left of the y axis.
template <typename ToY>
void draw_y_grid(Canvas& canvas, int left, int plot_w, const std::vector<double>& ticks, ToY to_y) {
  const std::array<uint8_t, 3> black{0, 0, 0}, grey{225, 225, 225};
  for (double v : ticks) {
    const int y = static_cast<int>(std::lround(to_y(v)));
    canvas.rect(left, y, left + plot_w, y + 1, grey);
    const auto label = format_tick(v);
    canvas.text(left - 6 - Canvas::text_width(label), y - 3, label, black);
  }
}

// The series' names from row `y` down, right-aligned at `right`, each after a swatch of its colour covering rows
// swatch_top to swatch_bottom of its line.
void draw_legend(Canvas& canvas, const std::vector<PlotSeries>& series, int right, int y, int swatch_top,
                 int swatch_bottom) {
  for (const auto& s : series) {
    const int x = right - Canvas::text_width(s.name) - 22;
    canvas.rect(x, y + swatch_top, x + 16, y + swatch_bottom, s.rgb);
    canvas.text(x + 22, y, s.name, {0, 0, 0});
    y += 14;
  }
}

}  // namespace

std::vector<double> round_ticks(double lo, double hi, int max_ticks) {
  if (!(hi > lo)) hi = lo + 1;
  max_ticks = std::max(max_ticks, 2);
  const double raw = (hi - lo) / (max_ticks - 1);
  const double decade = std::pow(10.0, std::floor(std::log10(raw)));
  double step = decade;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * decade;
    if (std::ceil(hi / step - 1e-9) - std::floor(lo / step + 1e-9) + 1 <= max_ticks) break;
  }
  std::vector<double> ticks;
  for (double k = std::floor(lo / step + 1e-9); k <= std::ceil(hi / step - 1e-9); ++k) ticks.push_back(k * step);
  return ticks;
}

void write_image_grid(const torch::Tensor& images, const std::string& path, int64_t columns) {
  TORCH_CHECK(images.dim() == 4 && (images.size(1) == 1 || images.size(1) == 3) && images.size(0) > 0,
              "write_image_grid: expected images [N, 1 or 3, H, W], got ", images.sizes());
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3), pad = 2;
  if (columns <= 0) columns = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int64_t rows = (n + columns - 1) / columns;
  auto pixels = ((images.detach().to(torch::kCPU, torch::kFloat).clamp(-1, 1) + 1) * 127.5).round().to(torch::kUInt8);
  auto grid = torch::zeros({rows * (h + pad) + pad, columns * (w + pad) + pad, c}, torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / columns, col = i % columns;
    grid.slice(0, pad + r * (h + pad), pad + r * (h + pad) + h)
        .slice(1, pad + col * (w + pad), pad + col * (w + pad) + w)
        .copy_(pixels[i].permute({1, 2, 0}));
  }
  // Small images (a 64-image grid of 32x32 samples is 274 px) are enlarged by a whole factor, each pixel a square,
  // to at least kMinGridWidth px across, so that a viewer shows them without its own blurring.
  const int64_t scale = std::max<int64_t>(1, (kMinGridWidth + grid.size(1) - 1) / grid.size(1));
  if (scale > 1) grid = grid.repeat_interleave(scale, 0).repeat_interleave(scale, 1);
  write_png(path, static_cast<int>(grid.size(1)), static_cast<int>(grid.size(0)), static_cast<int>(c),
            grid.contiguous().data_ptr<uint8_t>());
}

std::vector<std::string> plot_runs(const std::vector<std::pair<std::string, std::string>>& runs,
                                   const RunSeriesReader& add, const std::string& x_label, const std::string& y_label,
                                   const std::string& output) {
  if (runs.empty()) throw Error("plot: no runs to plot");
  std::vector<PlotSeries> series;
  std::vector<std::string> summary;
  for (size_t i = 0; i < runs.size(); ++i) summary.push_back(add(i, runs[i].first, runs[i].second, series));
  write_line_plot(series, x_label, output, 900, 480, y_label);
  return summary;
}

std::array<uint8_t, 3> run_colour(size_t i) {
  static const std::array<std::array<uint8_t, 3>, 10> palette{{{31, 119, 180}, {255, 127, 14}, {44, 160, 44},
                                                                {214, 39, 40}, {148, 103, 189}, {140, 86, 75},
                                                                {227, 119, 194}, {127, 127, 127}, {188, 189, 34},
                                                                {23, 190, 207}}};
  return palette[i % palette.size()];
}

void write_line_plot(const std::vector<PlotSeries>& series, const std::string& x_label, const std::string& path,
                     int width, int height, const std::string& y_label) {
  Canvas canvas(width, height);
  const int left = 60, right = 20, top = 20, bottom = 40;
  const int plot_w = width - left - right, plot_h = height - top - bottom;
  size_t count = 0;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& s : series) {
    count = std::max(count, s.values.size());
    for (double v : s.values)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-9) lo -= 0.5, hi += 0.5;
  const std::vector<double> y_ticks = round_ticks(lo, hi);
  lo = y_ticks.front();
  hi = y_ticks.back();
  const std::array<uint8_t, 3> black{0, 0, 0};
  auto to_x = [&](double i) { return left + (count > 1 ? (i - 1) / (count - 1) : 0.5) * plot_w; };
  auto to_y = [&](double v) { return top + (hi - v) / (hi - lo) * plot_h; };
  draw_y_grid(canvas, left, plot_w, y_ticks, to_y);
  for (double i : round_ticks(1, static_cast<double>(std::max<size_t>(count, 2)), 8)) {  // x ticks inside 1..count
    if (count == 0 || i < 1 || i > static_cast<double>(count)) continue;
    const int x = static_cast<int>(std::lround(to_x(i)));
    canvas.rect(x, top + plot_h, x + 1, top + plot_h + 4, black);
    const auto label = format_tick(i);
    canvas.text(x - Canvas::text_width(label) / 2, top + plot_h + 7, label, black);
  }
  canvas.rect(left, top, left + 1, top + plot_h + 1, black);
  canvas.rect(left, top + plot_h, left + plot_w + 1, top + plot_h + 1, black);
  canvas.text(left + plot_w / 2 - Canvas::text_width(x_label) / 2, height - 14, x_label, black);
  if (!y_label.empty()) canvas.text(6, 6, y_label, black);  // above the y axis's labels

  for (const auto& s : series) {
    // One point per pixel column at most: the mean of the values falling into it.
    const size_t n = s.values.size();
    const size_t per_point = std::max<size_t>(1, (n + plot_w - 1) / plot_w);
    double prev_x = NAN, prev_y = NAN;
    for (size_t start = 0; start < n; start += per_point) {
      const size_t end = std::min(n, start + per_point);
      double sum = 0;
      size_t finite = 0;
      for (size_t i = start; i < end; ++i)
        if (std::isfinite(s.values[i])) sum += s.values[i], ++finite;
      if (finite == 0) continue;
      const double x = to_x(0.5 * (start + end - 1) + 1), y = to_y(sum / finite);
      if (std::isfinite(prev_x)) canvas.line(prev_x, prev_y, x, y, s.rgb);
      else canvas.pixel(static_cast<int>(x), static_cast<int>(y), s.rgb);
      prev_x = x;
      prev_y = y;
    }
  }
  draw_legend(canvas, series, left + plot_w - 10, top + 6, 2, 5);  // top right, a line per series
  write_png(path, width, height, 3, canvas.rgb.data());
}

BarGroup& bar_group(std::vector<BarGroup>& groups, const std::string& label, size_t series) {
  auto group = std::find_if(groups.begin(), groups.end(), [&](const BarGroup& g) { return g.label == label; });
  if (group != groups.end()) return *group;
  groups.push_back({label, std::vector<double>(series, NAN)});
  return groups.back();
}

void write_bar_chart(const std::vector<BarGroup>& groups, const std::vector<PlotSeries>& series,
                     const std::string& y_label, const std::string& path, int width, int height) {
  if (groups.empty() || series.empty()) throw Error(path + ": a bar chart needs at least one group and one series");
  Canvas canvas(width, height);
  const int left = 60, right = 20, top = 20 + 14 * static_cast<int>(series.size()), bottom = 40;
  const int plot_w = width - left - right, plot_h = height - top - bottom;
  double hi = 0;
  for (const auto& g : groups)
    for (double v : g.values)
      if (std::isfinite(v)) hi = std::max(hi, v);
  if (hi <= 0) hi = 1;
  const std::vector<double> y_ticks = round_ticks(0.0, hi * 1.12);  // room for the value labels
  hi = y_ticks.back();
  const std::array<uint8_t, 3> black{0, 0, 0};
  auto to_y = [&](double v) { return static_cast<int>(std::lround(top + (hi - v) / hi * plot_h)); };
  draw_y_grid(canvas, left, plot_w, y_ticks, to_y);
  const double group_w = static_cast<double>(plot_w) / groups.size();
  const double bar_w = group_w * 0.8 / series.size();
  for (size_t g = 0; g < groups.size(); ++g) {
    const double x0 = left + g * group_w + group_w * 0.1;
    for (size_t s = 0; s < series.size() && s < groups[g].values.size(); ++s) {
      const double v = groups[g].values[s];
      if (!std::isfinite(v)) continue;
      const int xa = static_cast<int>(std::lround(x0 + s * bar_w)), xb = static_cast<int>(std::lround(x0 + (s + 1) * bar_w)) - 1;
      canvas.rect(xa, to_y(v), xb, top + plot_h, series[s].rgb);
      const auto label = format_tick(v);
      canvas.text((xa + xb) / 2 - Canvas::text_width(label) / 2, to_y(v) - 10, label, black);
    }
    const auto& label = groups[g].label;
    canvas.text(static_cast<int>(left + (g + 0.5) * group_w) - Canvas::text_width(label) / 2, top + plot_h + 7, label,
                black);
  }
  canvas.rect(left, top, left + 1, top + plot_h + 1, black);
  canvas.rect(left, top + plot_h, left + plot_w + 1, top + plot_h + 1, black);
  canvas.text(4, 4, y_label, black);
  draw_legend(canvas, series, left + plot_w - 10, 6, 1, 7);  // above the bars, a box per series
  write_png(path, width, height, 3, canvas.rgb.data());
}

}  // namespace hierpar::examples
