// hierpar's benchmark harness: CUDA-event timing with warm-up and medians, records in the shared JSON format
// (shared/BENCH_FORMAT.md), and a table with stock/hierpar ratios. A suite is a function that fills a Report;
// HIERPAR_BENCH_SUITE registers it under a name that `hierpar-bench <name>` runs.
#pragma once

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <functional>
#include <iosfwd>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace hierpar::bench {

// An ordered set of key -> JSON value, for a record's "config" and its extra fields.
class Config {
 public:
  Config& set(const std::string& key, const std::string& value);
  Config& set(const std::string& key, const char* value) { return set(key, std::string(value)); }
  Config& set(const std::string& key, double value);
  Config& set(const std::string& key, int64_t value);
  Config& set(const std::string& key, int value) { return set(key, static_cast<int64_t>(value)); }
  Config& set(const std::string& key, bool value);
  Config& set(const std::string& key, const std::vector<int64_t>& value);
  Config& set(const std::string& key, const std::vector<double>& value);

  std::string to_json() const;  // {"key": value, ...} in insertion order
  std::string to_text() const;  // key=value key=value, for the table
  bool empty() const { return values_.empty(); }
  const nlohmann::ordered_json& values() const { return values_; }

 private:
  nlohmann::ordered_json values_ = nlohmann::ordered_json::object();
};

struct Timing {
  double median_us = 0, min_us = 0;
  int repeats = 0;
};

// The median and minimum of samples in microseconds (at least one); repeats = their count.
Timing timing_of(std::vector<double> samples_us);

// Times fn on the current CUDA stream: `warmup` untimed calls, then `repeats` calls each between two CUDA
// events; returns the median and minimum. fn must only enqueue work (no host synchronisation).
Timing time_cuda(const std::function<void()>& fn, int warmup = 20, int repeats = 100);

// Host microseconds per call of fn: `warmup_rounds` untimed rounds, then `rounds` rounds of `calls` calls each, timed
// on the host's clock; the median and minimum over rounds, per call. `before_round` (if set) runs before every round
// and after the last, untimed (e.g. a device synchronisation, so that queued GPU work never delays the calls).
Timing time_host(const std::function<void()>& fn, int rounds, int calls, int warmup_rounds,
                 const std::function<void()>& before_round = {});

// `capture` (enqueue-only work that makes `calls` calls) captured in one CUDA graph on a pool stream (the legacy
// default stream cannot capture); the median replay time over `repeats` replays, per call: GPU time with no launch
// gaps, as a captured training step runs it. Warm up first what must not be captured (cuDNN's benchmark search).
Timing time_graph_per_call(const std::function<void()>& capture, int calls, int repeats);

// What the profiler (kineto/CUPTI) saw over `calls` calls of fn (run after a device sync; synced after). With a
// `trace_path`, the profile is also saved there as a Chrome trace (per-stream kernel timelines, eager operators).
struct Profile {
  int calls = 0;
  double kernels = 0, busy_us = 0, conversions = 0;  // per call; conversions: cuDNN's NCHW<->NHWC kernels
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> top;  // kernel -> (count, total us), by time
  // Eager calls only (a graph replay runs no operators): each aten::copy_ by the innermost operator around it
  // that is not a copy/conversion itself, with the copy's input shapes: where layout copies come from.
  std::map<std::string, int64_t> copies_by_caller;
  // The CUDA runtime and driver calls the host made, by name: (count, total host us) over all calls.
  std::map<std::string, std::pair<int64_t, double>> runtime_calls;
  bool available = false;
};
Profile profile(const std::function<void()>& fn, int calls, const std::string& trace_path = {});
// The kernels by GPU time, one line each: us and launches per call, name.
void write_kernels(std::ostream& os, const Profile& p);

struct Record {
  std::string bench, impl;
  Config config;
  Timing timing;
  Config extra;
};

class Report {
 public:
  // Also prints the record on stderr as it comes, with the suite's elapsed time: a suite runs for minutes before
  // its table.
  void add(const std::string& bench, const std::string& impl, const Config& config, const Timing& t,
           const Config& extra = {});
  const std::vector<Record>& records() const { return records_; }
  // One row per (bench, config): stock and hierpar medians and stock/hierpar (> 1: hierpar faster).
  void print_table(std::ostream& os) const;
  // The shared format: gpu, gpus, torch, cuda, commit, date, records.
  void write_json(const std::string& path) const;

 private:
  std::vector<Record> records_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

struct Options {
  bool quick = false;  // fewer repeats and shapes, for a smoke run
  std::string out_prefix;  // "<out>/<gpu>-<suite>": a suite may write files beside its JSON (e.g. <prefix>.png)
  std::vector<int64_t> batches;  // --batches: the batch sizes to run (empty: each suite's own)
  std::vector<std::string> skip;  // --skip: the step and strategy suites leave out rows whose label contains one
  // Under a launcher (torchrun: RANK, WORLD_SIZE): this process's rank and the process count. The strategy suite then
  // runs its multi-replica rows with the replicas spread over the processes, and rank 0 alone prints and writes.
  int64_t rank = 0, world_size = 1;

  // Whether --skip leaves out the row `label`; if so, says why in `skipped` ("<label>: --skip '<text>'").
  bool skips(const std::string& label, std::vector<std::string>& skipped) const {
    for (const std::string& text : skip) {
      if (label.find(text) == std::string::npos) continue;
      skipped.push_back(label + ": --skip '" + text + "'");
      return true;
    }
    return false;
  }

  // The batch sizes of a suite whose cases are built for any batch (the step suites, per-call overhead): --batches as
  // given, else the suite's own list.
  std::vector<int64_t> any_batches(const std::vector<int64_t>& own) const { return batches.empty() ? own : batches; }

  // The batch sizes of a suite with fixed cases: its own list, narrowed to --batches when given.
  std::vector<int64_t> pick_batches(const std::vector<int64_t>& own) const {
    if (batches.empty()) return own;
    std::vector<int64_t> picked;
    for (int64_t b : own) {
      for (int64_t wanted : batches) {
        if (b == wanted) picked.push_back(b);
      }
    }
    return picked;
  }
};

// The convolution suites' settings: batch 64 fp32 in NCHW and channels_last, batch 1024 bf16 channels_last.
struct ConvSetting {
  int64_t batch;
  at::ScalarType dtype;
  bool channels_last;
};
const std::vector<ConvSetting>& conv_settings();

// The file HIERPAR_BENCH_PROFILE names, opened for appending (suites add their kernel profiles to it); null when unset.
std::unique_ptr<std::ofstream> profile_file();

// Calls draw(path), which writes a chart there, and says so; in a build without the examples' PNG writer
// (HIERPAR_BENCH_CHARTS unset) says why there is no chart instead.
void write_chart_file(const std::string& path, const std::function<void(const std::string&)>& draw);

// `hierpar-bench SUITE --redraw RECORD.json`: a suite's chart drawn again from a record it wrote, without running
// anything (no GPU needed). A suite that draws a chart registers how: from the record's "records" list to `png`.
using Redraw = std::function<void(const nlohmann::json& records, const std::string& png)>;
bool register_redraw(const std::string& suite, Redraw redraw);
// Draws `suite`'s chart from the record at `path` to `png` (hierpar-bench names it after the record, in the output
// folder); false when the suite draws none. Throws std::runtime_error naming the file when it cannot be read as a
// record.
bool redraw_chart(const std::string& suite, const std::string& path, const std::string& png);

using Suite = std::function<void(Report&, const Options&)>;
// needs_cuda false: the suite also runs on a machine without a GPU (its records then say gpu "none").
bool register_suite(const std::string& name, Suite suite, bool needs_cuda = true);
const std::vector<std::pair<std::string, Suite>>& suites();
bool suite_needs_cuda(const std::string& name);

}  // namespace hierpar::bench

#define HIERPAR_BENCH_CONCAT_(a, b) a##b
#define HIERPAR_BENCH_CONCAT(a, b) HIERPAR_BENCH_CONCAT_(a, b)
#define HIERPAR_BENCH_SUITE(name, fn) \
  static const bool HIERPAR_BENCH_CONCAT(hierpar_bench_suite_, __LINE__) = ::hierpar::bench::register_suite(name, fn)
#define HIERPAR_BENCH_CPU_SUITE(name, fn)                                     \
  static const bool HIERPAR_BENCH_CONCAT(hierpar_bench_suite_, __LINE__) = \
      ::hierpar::bench::register_suite(name, fn, /*needs_cuda=*/false)
