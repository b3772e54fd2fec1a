#include "common/checkpoint.h"

#include "common/cli.h"

#include <ATen/Context.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <filesystem>
#include <mutex>
#include <sstream>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "hierpar-checkpoint-1";

at::Generator default_generator(torch::Device device) {
  return at::globalContext().defaultGenerator(device.is_cuda() && !device.has_index()
                                                  ? torch::Device(torch::kCUDA, 0)
                                                  : device);
}

std::string read_string(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toStringRef();
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toInt();
}

Config parse_config(const std::string& text) {
  Config config;
  std::istringstream is(text);
  std::string field;
  while (is >> field) {
    const auto eq = field.find('=');
    if (eq != std::string::npos) config[field.substr(0, eq)] = field.substr(eq + 1);
  }
  return config;
}

torch::serialize::InputArchive open_checkpoint(const std::string& path) {
  if (!fs::exists(path)) throw Error(path + ": no such checkpoint");
  torch::serialize::InputArchive archive;
  try {
    // Onto the CPU: a checkpoint from any device loads anywhere; the program moves what it loaded.
    archive.load_from(path, torch::kCPU);
    if (read_string(archive, "format") != kFormat) throw Error(path + ": not a hierpar checkpoint");
  } catch (const c10::Error& e) {
    throw Error(path + ": not a readable hierpar checkpoint (" +
                std::string(e.what_without_backtrace()).substr(0, std::string(e.what_without_backtrace()).find('\n')) + ")");
  }
  return archive;
}

CheckpointState read_state(torch::serialize::InputArchive& archive) {
  CheckpointState state;
  state.config = parse_config(read_string(archive, "config"));
  state.epoch = read_int(archive, "epoch");
  state.epoch_step = read_int(archive, "epoch_step");
  state.global_step = read_int(archive, "global_step");
  archive.read("history", state.history);
  return state;
}

}  // namespace

std::string to_string(const Config& config) {
  std::string out;
  for (const auto& [key, value] : config) out += (out.empty() ? "" : " ") + key + "=" + value;
  return out;
}

void save_checkpoint(const std::string& path, const CheckpointState& state, const NamedModules& modules,
                     const NamedOptimizers& optimizers, torch::Device device) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string(kFormat)));
  archive.write("config", c10::IValue(to_string(state.config)));
  archive.write("epoch", c10::IValue(state.epoch));
  archive.write("epoch_step", c10::IValue(state.epoch_step));
  archive.write("global_step", c10::IValue(state.global_step));
  archive.write("history", state.history.defined() ? state.history.cpu() : torch::empty({0, 0}), /*is_buffer=*/true);
  for (const auto& [name, module] : modules) {
    torch::serialize::OutputArchive sub;
    module->save(sub);
    archive.write("module/" + name, sub);
  }
  for (const auto& [name, optimizer] : optimizers) {
    torch::serialize::OutputArchive sub;
    optimizer->save(sub);
    archive.write("optimizer/" + name, sub);
  }
  {
    auto cpu = at::globalContext().defaultGenerator(torch::kCPU);
    std::lock_guard<std::mutex> lock(cpu.mutex());
    archive.write("rng/cpu", cpu.get_state(), /*is_buffer=*/true);
  }
  if (device.is_cuda()) {
    auto gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng/cuda", gen.get_state(), /*is_buffer=*/true);
  }
  const auto parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  const std::string temporary = path + ".tmp";
  try {
    archive.save_to(temporary);
  } catch (const c10::Error&) {
    std::remove(temporary.c_str());
    throw Error(temporary + ": cannot write checkpoint");
  }
  std::error_code ec;
  fs::rename(temporary, path, ec);  // atomic on POSIX: readers see the old or the new file, never a mix
  if (ec) throw Error(path + ": cannot replace checkpoint (" + ec.message() + ")");
}

CheckpointState read_checkpoint_state(const std::string& path) {
  auto archive = open_checkpoint(path);
  return read_state(archive);
}

void require_config(const std::string& path, const Config& found, const Config& expected) {
  std::string differences;
  for (const auto& [key, value] : expected) {
    auto it = found.find(key);
    const std::string had = it == found.end() ? "(none)" : it->second;
    if (had != value) differences += (differences.empty() ? "" : ", ") + key + " " + had + " vs " + value;
  }
  if (!differences.empty())
    throw Error(path + " is from another configuration (checkpoint vs this run: " + differences +
                "); use the same flags or another --out");
}

CheckpointState load_checkpoint(const std::string& path, const Config& expected, const NamedModules& modules,
                                const NamedOptimizers& optimizers, torch::Device device, bool restore_rng) {
  auto archive = open_checkpoint(path);
  auto state = read_state(archive);
  require_config(path, state.config, expected);
  try {
    for (const auto& [name, module] : modules) {
      torch::serialize::InputArchive sub;
      archive.read("module/" + name, sub);
      module->load(sub);
    }
    for (const auto& [name, optimizer] : optimizers) {
      torch::serialize::InputArchive sub;
      archive.read("optimizer/" + name, sub);
      optimizer->load(sub);
    }
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw Error(path + ": cannot load the model or optimiser state (" + what.substr(0, what.find('\n')) + ")");
  }
  if (restore_rng) {
    torch::Tensor cpu_state;
    archive.read("rng/cpu", cpu_state);
    auto cpu = at::globalContext().defaultGenerator(torch::kCPU);
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      cpu.set_state(cpu_state);
    }
    torch::Tensor cuda_state;
    if (device.is_cuda() && archive.try_read("rng/cuda", cuda_state)) {
      auto gen = default_generator(device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cuda_state);
    }
  }
  return state;
}

}  // namespace hierpar::examples
