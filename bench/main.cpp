// hierpar-bench: runs benchmark suites on the GPU, prints a table per suite and writes
// <out>/<gpu>-<suite>.json (shared/BENCH_FORMAT.md). <out> is --out DIR, else $HIERPAR_BENCH_OUT, else
// ~/.cache/hierpar/bench: outside the repository (committing a record to bench/results is a deliberate copy).
//   hierpar-bench [all | SUITE...] [--quick] [--batches N,N...] [--skip TEXT] [--out DIR] [--list]
//   hierpar-bench SUITE --redraw RECORD.json [--out DIR]   (the suite's chart again from its record: <out>/RECORD.png;
//                                                          no GPU needed)
//   hierpar-bench --help
#include "bench.h"

#include "hierpar/strategy/placement.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string slug(std::string s) {
  for (auto& c : s) c = std::isalnum(static_cast<unsigned char>(c)) ? std::tolower(c) : '-';
  auto pos = s.find("nvidia-");
  if (pos == 0) s = s.substr(7);
  return s;
}

// A crash inside a library (NCCL, cuBLAS, the driver) in a long run prints the native stack before the process
// dies, so the log says where it happened. Only async-signal-safe calls (write, backtrace_symbols_fd).
void print_stack_and_reraise(int signal) {
  constexpr char message[] = "hierpar-bench: fatal signal; native stack:\n";
  [[maybe_unused]] auto written = write(STDERR_FILENO, message, sizeof message - 1);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

constexpr char kUsage[] =
    "usage: hierpar-bench [all | SUITE...] [--quick] [--batches N,N...] [--skip TEXT] [--out DIR] [--list]\n"
    "       hierpar-bench SUITE --redraw RECORD.json [--out DIR]\n";

// Where the records and charts go without --out: $HIERPAR_BENCH_OUT, else ~/.cache/hierpar/bench (outside the
// repository: a run never rewrites the committed records in bench/results unless --out names that folder). Empty when
// neither HIERPAR_BENCH_OUT nor HOME is set.
std::string default_out_dir() {
  if (const char* env = std::getenv("HIERPAR_BENCH_OUT"); env && *env) return env;
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/hierpar/bench";
  return {};
}

int usage(const std::string& error) {
  std::cerr << "hierpar-bench: " << error << "\n" << kUsage;
  return 2;
}

int help() {
  std::cout << kUsage
            << "Times hierpar's operators and training steps against stock LibTorch in the same process on the GPU;\n"
               "prints a table per suite and writes <out>/<gpu>-<suite>.json (and a chart where the suite draws one).\n"
               "  SUITE            one or more of the suites (--list); all or none: every suite\n"
               "  --quick          fewer shapes and batches\n"
               "  --batches N,N    batch sizes: dcgan_step and overhead run any; the other suites keep those of their cases\n"
               "                   that are in the list\n"
               "  --skip TEXT      leave out the rows whose label contains TEXT (repeatable), e.g. 'graphs off'\n"
               "  --out DIR        where the records (and charts) go; default $HIERPAR_BENCH_OUT if set, else\n"
               "                   ~/.cache/hierpar/bench (outside the repository: to keep a record in bench/results,\n"
               "                   copy it there, or pass --out bench/results); the run says where they went\n"
               "  --list           the suites, one a line\n"
               "  --redraw RECORD  draw SUITE's chart again from a record it wrote (no GPU needed): the chart is\n"
               "                   written to <out>/RECORD.png (RECORD's name, .png for .json) in --out DIR or the\n"
               "                   default folder above, never beside RECORD unless --out names its folder\n"
               "Under torchrun the strategy suite runs one process per GPU; rank 0 prints and writes the record.\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hierpar::bench;
  void* first_frame[1];
  backtrace(first_frame, 1);  // loads the unwinder now: its first call allocates, which a signal handler must not
  for (int fatal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(fatal, print_stack_and_reraise);
  // Kineto leaves CUPTI attached after a profile unless told otherwise (pytorch#144455), and every later kernel
  // launch then costs more: rows timed after another row's profile (the suites profile each row) would be charged
  // for it, the rows that launch the most kernels the most. TEARDOWN_CUPTI=0 in the environment keeps it attached.
  setenv("TEARDOWN_CUPTI", "1", /*overwrite=*/0);
  Options options;
  std::string out_dir;  // --out; empty: default_out_dir()
  std::vector<std::string> wanted;
  std::string redraw;  // --redraw: a record whose chart to draw again
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      return help();
    } else if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--batches") {
      if (++i == argc) return usage("--batches needs a list of batch sizes, e.g. 4096 or 64,1024");
      std::stringstream list(argv[i]);
      std::string item;
      while (std::getline(list, item, ',')) {
        char* end = nullptr;
        const long long batch = std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || batch < 1) return usage("--batches: '" + item + "' is not a batch size");
        options.batches.push_back(batch);
      }
    } else if (arg == "--skip") {
      if (++i == argc) return usage("--skip needs the text of the row labels to leave out, e.g. 'sync BN'");
      options.skip.push_back(argv[i]);
    } else if (arg == "--out") {
      if (++i == argc) return usage("--out needs a directory");
      out_dir = argv[i];
    } else if (arg == "--redraw") {
      if (++i == argc)
        return usage("--redraw needs a record the suite wrote, e.g. bench/results/h200x4-strategy-bf16.json");
      redraw = argv[i];
    } else if (arg == "--list") {
      for (const auto& [name, suite] : suites()) std::cout << name << "\n";
      return 0;
    } else if (!arg.empty() && arg[0] == '-') {
      return usage("unknown flag " + arg);
    } else {
      wanted.push_back(arg);
    }
  }
  const bool out_given = !out_dir.empty();
  if (!out_given) {
    out_dir = default_out_dir();
    if (out_dir.empty()) return usage("neither --out, HIERPAR_BENCH_OUT nor HOME is set: name a folder with --out DIR");
  }
  // One line saying where the records (or the chart) go, and why there.
  const auto say_out = [&] {
    std::cout << "hierpar-bench: writing to " << out_dir
              << (out_given                        ? " (--out)"
                  : std::getenv("HIERPAR_BENCH_OUT") && *std::getenv("HIERPAR_BENCH_OUT")
                      ? " ($HIERPAR_BENCH_OUT; --out DIR to change)"
                      : " (the default; --out DIR or $HIERPAR_BENCH_OUT to change)")
              << std::endl;
  };
  if (!redraw.empty()) {
    if (wanted.size() != 1) return usage("--redraw: name the one suite that wrote the record, e.g. strategy");
    if (std::none_of(suites().begin(), suites().end(), [&](const auto& s) { return s.first == wanted[0]; }))
      return usage("no suite named '" + wanted[0] + "' (--list shows them)");
    try {
      // The chart is named after the record (.png for .json) and goes into the output folder, not beside the record.
      std::filesystem::path name = std::filesystem::path(redraw).filename();
      if (name.extension() == ".json") name.replace_extension();
      const std::string png = (std::filesystem::path(out_dir) / name).string() + ".png";
      say_out();
      std::filesystem::create_directories(out_dir);
      if (!redraw_chart(wanted[0], redraw, png)) return usage("--redraw: suite '" + wanted[0] + "' draws no chart");
    } catch (const std::exception& e) {
      std::cerr << "hierpar-bench: --redraw: " << e.what() << "\n";
      return 1;
    }
    return 0;
  }
  if (wanted.empty() || std::find(wanted.begin(), wanted.end(), "all") != wanted.end()) {
    wanted.clear();
    for (const auto& [name, suite] : suites()) wanted.push_back(name);
  }
  for (const auto& name : wanted) {
    bool known = std::any_of(suites().begin(), suites().end(), [&](const auto& s) { return s.first == name; });
    if (!known) return usage("no suite named '" + name + "' (--list shows them)");
  }
  const bool cuda = at::cuda::is_available();
  for (const auto& name : wanted) {
    if (!cuda && suite_needs_cuda(name)) {
      std::cerr << "hierpar-bench: no CUDA device; suite " << name << " compares GPU kernels and needs one\n";
      return 2;
    }
  }
  at::globalContext().setBenchmarkCuDNN(true);  // stock at its strongest
  std::filesystem::create_directories(out_dir);
  const std::string gpu = cuda ? slug(at::cuda::getCurrentDeviceProperties()->name) : "cpu";
  const auto launch = hierpar::strategy::Launch::from_env();
  options.rank = launch.rank;
  options.world_size = launch.world_size;
  // Several processes write one record, named after their count; rank 0 writes it.
  const std::string processes = launch.multi_process() ? "-" + std::to_string(launch.world_size) + "procs" : "";
  const bool reports = launch.rank == 0;
  if (reports) say_out();
  int failed = 0;
  for (const auto& [name, suite] : suites()) {
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    if (reports) std::cout << "== " << name << (options.quick ? " (quick)" : "") << " on " << gpu << std::endl;
    Report report;
    options.out_prefix = out_dir + "/" + gpu + "-" + name + processes;
    // A suite that fails (an error, running out of memory) says why in one line; the rows it measured before that
    // are still printed and written.
    try {
      suite(report, options);
    } catch (const c10::Error& e) {
      std::cerr << "hierpar-bench: suite " << name << " failed: " << e.what_without_backtrace() << "\n";
      ++failed;
    } catch (const std::exception& e) {
      std::cerr << "hierpar-bench: suite " << name << " failed: " << e.what() << "\n";
      ++failed;
    }
    if (!reports || report.records().empty()) continue;
    report.print_table(std::cout);
    const std::string path = options.out_prefix + ".json";
    report.write_json(path);
    std::cout << "wrote " << path << "\n" << std::endl;
  }
  return failed ? 1 : 0;
}
