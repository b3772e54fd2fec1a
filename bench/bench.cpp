#include "bench.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

namespace hierpar::bench {
namespace {

// Six significant digits, as the records have always had; not finite: null.
nlohmann::ordered_json rounded(double v) {
  if (!std::isfinite(v)) return nullptr;
  std::ostringstream os;
  os << std::setprecision(6) << v;
  return std::stod(os.str());
}

std::string gpu_name() {
  if (!at::cuda::is_available()) return "none";
  return at::cuda::getCurrentDeviceProperties()->name;
}

std::string today() {
  std::time_t now = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

}  // namespace

Config& Config::set(const std::string& key, const std::string& value) { values_[key] = value; return *this; }
Config& Config::set(const std::string& key, double value) { values_[key] = rounded(value); return *this; }
Config& Config::set(const std::string& key, int64_t value) { values_[key] = value; return *this; }
Config& Config::set(const std::string& key, bool value) { values_[key] = value; return *this; }
Config& Config::set(const std::string& key, const std::vector<int64_t>& value) { values_[key] = value; return *this; }
Config& Config::set(const std::string& key, const std::vector<double>& value) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (double v : value) list.push_back(rounded(v));
  values_[key] = std::move(list);
  return *this;
}

std::string Config::to_json() const { return values_.dump(); }

std::string Config::to_text() const {
  std::string s;
  for (const auto& [key, value] : values_.items()) {
    s += (s.empty() ? "" : " ") + key + "=" + (value.is_string() ? value.get<std::string>() : value.dump());
  }
  return s;
}

Timing time_cuda(const std::function<void()>& fn, int warmup, int repeats) {
  if (!at::cuda::is_available()) throw std::runtime_error("time_cuda: no CUDA device");
  for (int i = 0; i < warmup; ++i) fn();
  auto stream = at::cuda::getCurrentCUDAStream();
  std::vector<at::cuda::CUDAEvent> starts(repeats), ends(repeats);
  for (auto& e : starts) e = at::cuda::CUDAEvent(cudaEventDefault);
  for (auto& e : ends) e = at::cuda::CUDAEvent(cudaEventDefault);
  for (int i = 0; i < repeats; ++i) {
    starts[i].record(stream);
    fn();
    ends[i].record(stream);
  }
  stream.synchronize();
  std::vector<double> us(repeats);
  for (int i = 0; i < repeats; ++i) us[i] = 1000.0 * starts[i].elapsed_time(ends[i]);
  return timing_of(std::move(us));
}

Timing timing_of(std::vector<double> samples_us) {
  TORCH_CHECK(!samples_us.empty(), "timing_of: no samples");
  std::sort(samples_us.begin(), samples_us.end());
  const size_t n = samples_us.size();
  Timing t;
  t.repeats = static_cast<int>(n);
  t.min_us = samples_us.front();
  t.median_us = n % 2 ? samples_us[n / 2] : 0.5 * (samples_us[n / 2 - 1] + samples_us[n / 2]);
  return t;
}

Timing time_host(const std::function<void()>& fn, int rounds, int calls, int warmup_rounds,
                 const std::function<void()>& before_round) {
  std::vector<double> per_call;
  for (int r = -warmup_rounds; r < rounds; ++r) {
    if (before_round) before_round();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    if (r >= 0) per_call.push_back(us / calls);
  }
  if (before_round) before_round();
  return timing_of(std::move(per_call));
}

void Report::add(const std::string& bench, const std::string& impl, const Config& config, const Timing& t,
                 const Config& extra) {
  records_.push_back({bench, impl, config, t, extra});
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::cerr << "  [" << records_.size() << " rows, " << std::fixed << std::setprecision(0) << elapsed << " s] "
            << bench << " " << impl << " " << config.to_text() << ": " << std::setprecision(1) << t.median_us
            << " us" << std::defaultfloat << std::endl;
}

void Report::print_table(std::ostream& os) const {
  // Group by (bench, config) in first-seen order; columns: stock, hierpar, ratio.
  std::vector<std::string> order;
  std::map<std::string, std::map<std::string, double>> rows;
  std::map<std::string, std::string> labels;
  for (const auto& r : records_) {
    std::string key = r.bench + " " + r.config.to_json();
    if (!rows.count(key)) {
      order.push_back(key);
      labels[key] = r.bench + "  " + r.config.to_text();
    }
    rows[key][r.impl] = r.timing.median_us;
  }
  size_t width = 10;
  for (const auto& [k, label] : labels) width = std::max(width, label.size());
  os << std::left << std::setw(static_cast<int>(width)) << "benchmark" << std::right << std::setw(14)
     << "stock us" << std::setw(14) << "hierpar us" << std::setw(16) << "stock/hierpar" << "\n";
  os << std::string(width + 44, '-') << "\n";
  for (const auto& key : order) {
    const auto& impls = rows[key];
    auto get = [&](const char* impl) { return impls.count(impl) ? impls.at(impl) : NAN; };
    double stock = get("stock"), ours = get("hierpar");
    os << std::left << std::setw(static_cast<int>(width)) << labels[key] << std::right << std::fixed
       << std::setprecision(1) << std::setw(14) << stock << std::setw(14) << ours << std::setprecision(2)
       << std::setw(15) << stock / ours << "x\n";
    os.unsetf(std::ios::fixed);
  }
}

void Report::write_json(const std::string& path) const {
  const char* commit = std::getenv("HIERPAR_COMMIT");
  nlohmann::ordered_json doc;
  doc["gpu"] = gpu_name();
  doc["gpus"] = at::cuda::is_available() ? at::cuda::device_count() : 0;
  doc["torch"] = TORCH_VERSION;
  doc["cuda"] = at::cuda::is_available()
                    ? std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10)
                    : "none";
  doc["commit"] = commit ? commit : "unknown";
  doc["date"] = today();
  doc["records"] = nlohmann::ordered_json::array();
  for (const auto& r : records_) {
    nlohmann::ordered_json record{{"bench", r.bench}, {"impl", r.impl}, {"config", r.config.values()},
                                  {"median_us", rounded(r.timing.median_us)}, {"min_us", rounded(r.timing.min_us)},
                                  {"repeats", r.timing.repeats}};
    for (const auto& [key, value] : r.extra.values().items()) record[key] = value;
    doc["records"].push_back(std::move(record));
  }
  // One record per line, as the committed records read.
  std::ofstream out(path + ".tmp");
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "{\n";
  size_t field = 0;
  for (const auto& [key, value] : doc.items()) {
    out << "  " << nlohmann::ordered_json(key).dump() << ": ";
    if (key == "records") {
      out << "[\n";
      for (size_t i = 0; i < value.size(); ++i) out << "    " << value[i].dump() << (i + 1 < value.size() ? "," : "") << "\n";
      out << "  ]";
    } else {
      out << value.dump();
    }
    out << (++field < doc.size() ? ",\n" : "\n");
  }
  out << "}\n";
  out.close();
  if (!out || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) throw std::runtime_error("cannot write " + path);
}

namespace {
std::vector<std::pair<std::string, Suite>>& registry() {
  static std::vector<std::pair<std::string, Suite>> all;
  return all;
}
std::set<std::string>& cpu_suites() {
  static std::set<std::string> names;
  return names;
}
}  // namespace

bool register_suite(const std::string& name, Suite suite, bool needs_cuda) {
  registry().emplace_back(name, std::move(suite));
  if (!needs_cuda) cpu_suites().insert(name);
  return true;
}

namespace {
std::map<std::string, Redraw>& redraws() {
  static std::map<std::string, Redraw> all;
  return all;
}
}  // namespace

bool register_redraw(const std::string& suite, Redraw redraw) {
  redraws()[suite] = std::move(redraw);
  return true;
}

bool redraw_chart(const std::string& suite, const std::string& path, const std::string& png) {
  const auto it = redraws().find(suite);
  if (it == redraws().end()) return false;
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read the record");
  const nlohmann::json record = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (record.is_discarded() || !record.is_object() || !record.contains("records") || !record["records"].is_array())
    throw std::runtime_error(path + ": not a hierpar-bench record (a JSON object with a \"records\" list)");
  it->second(record["records"], png);
  return true;
}

bool suite_needs_cuda(const std::string& name) { return cpu_suites().count(name) == 0; }

const std::vector<std::pair<std::string, Suite>>& suites() { return registry(); }

const std::vector<ConvSetting>& conv_settings() {
  static const std::vector<ConvSetting> settings{
      {64, at::kFloat, false}, {64, at::kFloat, true}, {1024, at::kBFloat16, true}};
  return settings;
}

std::unique_ptr<std::ofstream> profile_file() {
  const char* path = std::getenv("HIERPAR_BENCH_PROFILE");
  return path ? std::make_unique<std::ofstream>(path, std::ios::app) : nullptr;
}

Timing time_graph_per_call(const std::function<void()>& capture, int calls, int repeats) {
  c10::cuda::device_synchronize();
  at::cuda::CUDAGraph graph;
  {
    const c10::cuda::CUDAStreamGuard on_pool_stream(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    capture();
    graph.capture_end();
  }
  c10::cuda::device_synchronize();
  Timing t = time_cuda([&] { graph.replay(); }, 3, repeats);
  t.median_us /= calls;
  t.min_us /= calls;
  return t;
}

Profile profile(const std::function<void()>& fn, int calls, const std::string& trace_path) {
  using namespace torch::autograd::profiler;
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/true);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  at::cuda::getCurrentCUDAStream().synchronize();
  prepareProfiler(config, activities);
  enableProfiler(config, activities);
  for (int i = 0; i < calls; ++i) fn();
  at::cuda::getCurrentCUDAStream().synchronize();
  auto result = disableProfiler();
  if (!trace_path.empty()) result->save(trace_path);
  Profile p;
  p.calls = calls;
  std::map<std::string, std::pair<int64_t, double>> by_name;
  for (const auto& e : result->events()) {
    if (e.activityType() == static_cast<uint8_t>(libkineto::ActivityType::CUDA_RUNTIME) ||
        e.activityType() == static_cast<uint8_t>(libkineto::ActivityType::CUDA_DRIVER)) {
      auto& call = p.runtime_calls[e.name()];
      call.first += 1;
      call.second += e.durationNs() / 1e3;
      continue;
    }
    if (e.activityType() != static_cast<uint8_t>(libkineto::ActivityType::CONCURRENT_KERNEL)) continue;
    const std::string name = e.name();
    auto& entry = by_name[name];
    entry.first += 1;
    entry.second += e.durationNs() / 1e3;
    p.kernels += 1;
    p.busy_us += e.durationNs() / 1e3;
    if (name.find("nchwToNhwc") != std::string::npos || name.find("nhwcToNchw") != std::string::npos) p.conversions += 1;
  }
  p.available = p.kernels > 0;
  const std::set<std::string> copy_like{"aten::copy_", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy",
                                        "aten::copy", "aten::empty_like", "aten::empty_strided"};
  const auto& events = result->events();
  for (const auto& copy : events) {
    if (copy.deviceType() != c10::DeviceType::CPU || copy.name() != "aten::copy_") continue;
    const torch::autograd::profiler::KinetoEvent* caller = nullptr;
    for (const auto& e : events) {
      if (e.deviceType() != c10::DeviceType::CPU || e.startThreadId() != copy.startThreadId() ||
          copy_like.count(e.name()) || e.startNs() > copy.startNs() || e.endNs() < copy.endNs())
        continue;
      if (!caller || e.durationNs() < caller->durationNs()) caller = &e;
    }
    std::ostringstream key;
    key << (caller ? caller->name() : std::string("(no enclosing operator)")) << " <- copy_";
    if (copy.hasShapes()) {
      for (const auto& shape : copy.shapes()) key << " " << c10::IntArrayRef(shape);
    }
    p.copies_by_caller[key.str()] += 1;
  }
  p.kernels /= calls;
  p.busy_us /= calls;
  p.conversions /= calls;
  p.top.assign(by_name.begin(), by_name.end());
  std::sort(p.top.begin(), p.top.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  return p;
}


void write_kernels(std::ostream& os, const Profile& p) {
  const auto flags = os.flags();
  os << std::fixed;
  for (const auto& [name, entry] : p.top) {
    os << "  " << std::setw(9) << std::setprecision(1) << entry.second / p.calls << " us/call " << std::setw(5)
       << std::setprecision(1) << double(entry.first) / p.calls << "x  " << name.substr(0, 140) << "\n";
  }
  os.flags(flags);
}

void write_chart_file(const std::string& path, const std::function<void(const std::string&)>& draw) {
#ifdef HIERPAR_BENCH_CHARTS
  draw(path);
  std::cout << "wrote " << path << "\n";
#else
  (void)draw;
  std::cout << "no chart (" << path << "): hierpar-bench was built without the examples' PNG writer\n";
#endif
}

}  // namespace hierpar::bench
