// What the tests of the examples' shared code (examples/common) and of the hierpar-dcgan program share: temporary
// folders, small data files in the formats the loaders read, a tiny training configuration, running the program
// and checking its one-line errors. Used by tests/test_examples*.cpp.
#pragma once

#include "testing.h"
#include "common/batch_tuning.h"
#include "common/checkpoint.h"
#include "common/cli.h"
#include "common/data.h"
#include "common/dcgan_app.h"
#include "common/loss_log.h"
#include "common/quality.h"
#include "common/shared_flags.h"
#include "common/images.h"
#include <torch/optim/adam.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <stb/stb_image.h>
#include <stb/stb_image_write.h>
#include <zlib.h>
#include <cstdio>
#include <cstring>
#include <ftw.h>
#include <sys/wait.h>
#include <algorithm>
#include <csignal>
#include <vector>
#include <unistd.h>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace hierpar::examples_testing {

namespace fs = std::filesystem;
using namespace hierpar::examples;
using hierpar::testing::rand_int;

// Expects `statement` to throw hierpar::examples::Error (one line) containing `substring`.
#define EXPECT_ERROR_MSG(statement, substring)                                                          \
  do {                                                                                                  \
    try {                                                                                               \
      statement;                                                                                        \
      ADD_FAILURE() << "expected an error containing \"" << (substring) << "\", got none";              \
    } catch (const Error& e) {                                                                          \
      const std::string what = e.what();                                                                \
      EXPECT_NE(what.find(substring), std::string::npos) << "error message was: " << what;              \
      EXPECT_EQ(what.find('\n'), std::string::npos) << "not one line: " << what;                        \
    }                                                                                                   \
  } while (0)

// Removes a folder tree. Not std::filesystem::remove_all: libtorch.so exports its own copy of that symbol,
// which crashes when it interposes on libstdc++'s.
inline void remove_tree(const fs::path& path) {
  ::nftw(path.c_str(), [](const char* file, const struct stat*, int, struct FTW*) { return ::remove(file); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

// A fresh folder under the system temp dir, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("hierpar-test-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    remove_tree(path);
    fs::create_directories(path);
  }
  ~TempDir() { remove_tree(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline std::string idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data, uint8_t type = 0x08) {
  std::string s{0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims)
    for (int shift : {24, 16, 8, 0}) s.push_back(static_cast<char>((d >> shift) & 0xff));
  s.append(data.begin(), data.end());
  return s;
}

inline void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
}

inline std::vector<uint8_t> random_bytes(size_t n, int hi = 255) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rand_int(0, hi));
  return v;
}

// A small Fashion-MNIST-format pair of files (images and labels) in `dir`.
inline void write_fake_mnist(const std::string& dir, const std::string& split, uint32_t n) {
  write_gz(dir + "/" + split + "-images-idx3-ubyte.gz", idx_bytes({n, 28, 28}, random_bytes(n * 28 * 28)));
  write_gz(dir + "/" + split + "-labels-idx1-ubyte.gz", idx_bytes({n}, random_bytes(n, 9)));
}

inline void write_png(const std::string& path, int w, int h, int channels, const std::vector<uint8_t>& pixels) {
  ASSERT_TRUE(stbi_write_png(path.c_str(), w, h, channels, pixels.data(), w * channels)) << path;
}

inline bool have_fashion_mnist() { return fs::exists(default_fashion_mnist_dir() + "/train-images-idx3-ubyte.gz"); }

inline DCGANTrainConfig tiny_training(const std::string& out) {
  DCGANTrainConfig c;
  c.data = have_fashion_mnist() ? "fashion-mnist" : "synthetic";
  c.limit = 64;
  c.model.image_size = 32;
  c.model.width = 0.25;
  c.model.channels = 1;
  c.batch_size = 16;
  c.epochs = 2;
  c.samples = 4;
  c.device = "cpu";
  c.seed = 7;
  c.out = out;
  c.quiet = true;
  return c;
}

inline hierpar::models::Generator trained_generator(const std::string& checkpoint) {
  return load_generator(checkpoint, hierpar::LayerSet::stock, torch::kCPU);
}

// ---- running hierpar-dcgan ------------------------------------------------------------------------------------

// hierpar-dcgan's commands, in the order its usage and its unknown-command line list them.
inline const std::vector<std::string>& dcgan_commands() {
  static const std::vector<std::string> commands{"train", "generate", "evaluate", "export", "plot", "tune", "data-speed"};
  return commands;
}

struct ProgramResult {
  int status;
  std::vector<std::string> stderr_lines;
  std::string command;  // the first word of the arguments
};

inline std::vector<std::string> lines_of_file(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

inline ProgramResult run_dcgan(const std::string& args, const TempDir& dir) {
  const std::string err = dir / "stderr.txt";
  const std::string command = std::string(HIERPAR_DCGAN_PROGRAM) + " " + args + " > /dev/null 2> " + err;
  const int raw = std::system(command.c_str());
  ProgramResult r{WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, lines_of_file(err), args.substr(0, args.find(' '))};
  return r;
}

// `hierpar-dcgan <args>` started in the background, its stderr to `err` (for sending it signals): its pid.
inline pid_t start_dcgan(const std::string& args, const std::string& err) {
  const std::string command = "exec " + std::string(HIERPAR_DCGAN_PROGRAM) + " " + args + " > /dev/null 2> " + err;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

// Whether `path` gets a line starting with `prefix` within `limit`.
inline bool wait_for_line(const std::string& path, const std::string& prefix, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    for (const auto& line : lines_of_file(path))
      if (line.rfind(prefix, 0) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The exit status of a process start_dcgan started (-1 if a signal ended it).
inline int wait_for_exit(pid_t pid) {
  int raw = 0;
  if (::waitpid(pid, &raw, 0) != pid) return -1;
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

// What `hierpar-dcgan <args>` prints on stdout.
inline std::string dcgan_stdout(const std::string& args) {
  std::string out;
  FILE* pipe = ::popen((std::string(HIERPAR_DCGAN_PROGRAM) + " " + args + " 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  ::pclose(pipe);
  return out;
}

// Bad data, files or folders: one line and exit status 1.
inline void expect_one_line_error(const ProgramResult& r, const std::string& substring, const std::string& what,
                           int status = 1) {
  EXPECT_EQ(r.status, status) << what;
  ASSERT_EQ(r.stderr_lines.size(), 1u) << what << ": stderr was:\n"
                                       << c10::Join("\n", r.stderr_lines);
  EXPECT_EQ(r.stderr_lines[0].rfind("hierpar-dcgan: error: ", 0), 0u) << r.stderr_lines[0];
  EXPECT_NE(r.stderr_lines[0].find(substring), std::string::npos) << what << ": " << r.stderr_lines[0];
}

// A bad flag or combination of flags: one line pointing at the command's --help (the program's for an unknown
// command), and exit status 2.
inline void expect_flag_error(const ProgramResult& r, const std::string& substring, const std::string& what) {
  expect_one_line_error(r, substring, what, 2);
  if (r.stderr_lines.size() == 1) {
    const std::string& line = r.stderr_lines[0];
    const auto& commands = dcgan_commands();
    const bool known = std::find(commands.begin(), commands.end(), r.command) != commands.end();
    const std::string tail = "(see hierpar-dcgan " + (known ? r.command + " " : std::string()) + "--help)";
    EXPECT_TRUE(line.size() >= tail.size() && line.compare(line.size() - tail.size(), tail.size(), tail) == 0) << line;
  }
}

}  // namespace hierpar::examples_testing
