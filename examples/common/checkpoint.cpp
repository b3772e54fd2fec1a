#include "common/checkpoint.h"

#include "common/cli.h"

#include <ATen/Context.h>
#include <c10/util/irange.h>
#include <torch/optim/adam.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "hierpar-checkpoint-2";  // 2: the configuration is a dictionary

at::Generator default_generator(torch::Device device) {
  return at::globalContext().defaultGenerator(device.is_cuda() && !device.has_index()
                                                  ? torch::Device(torch::kCUDA, 0)
                                                  : device);
}

std::string shape_text(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes() << " " << t.scalar_type();
  return os.str();
}

// The first line of a LibTorch error, for the rare message worth passing on whole.
std::string first_line(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  return what.substr(0, what.find('\n'));
}

// LibTorch archives are zip files; anything else is not a checkpoint at all.
bool looks_like_zip(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0;
}

// A checkpoint opened for reading, with one-line errors that name the file and the entry.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {
    if (!fs::exists(path_)) throw Error(path_ + ": no such checkpoint");
    if (!looks_like_zip(path_)) throw Error(path_ + ": not a hierpar checkpoint (not a LibTorch archive)");
    try {
      // Onto the CPU: a checkpoint from any device loads anywhere; the program moves what it loaded.
      archive_.load_from(path_, torch::kCPU);
    } catch (const c10::Error&) {
      throw Error(path_ + ": truncated or damaged checkpoint (LibTorch cannot read the archive)");
    }
    c10::IValue format;
    if (!archive_.try_read("format", format) || !format.isString() ||
        (format.toStringRef() != kFormat && format.toStringRef() != "hierpar-checkpoint-1"))
      throw Error(path_ + ": not a hierpar checkpoint (a LibTorch archive of something else)");
  }

  const std::string& path() const { return path_; }
  torch::serialize::InputArchive& archive() { return archive_; }

  c10::IValue value(const std::string& key) {
    c10::IValue v;
    if (!archive_.try_read(key, v)) missing(key);
    return v;
  }
  int64_t integer(const std::string& key) {
    const auto v = value(key);
    if (!v.isInt()) wrong(key, "an integer");
    return v.toInt();
  }
  torch::Tensor tensor(torch::serialize::InputArchive& archive, const std::string& key, const std::string& entry,
                       bool is_buffer) {
    torch::Tensor t;
    if (!archive.try_read(key, t, is_buffer)) missing(entry);
    return t;
  }
  torch::serialize::InputArchive sub(torch::serialize::InputArchive& archive, const std::string& key,
                                     const std::string& entry) {
    torch::serialize::InputArchive s;
    if (!archive.try_read(key, s)) missing(entry);
    return s;
  }

  Config config() {
    const auto v = value("config");
    Config config;
    if (v.isGenericDict()) {
      for (const auto& item : v.toGenericDict()) config[item.key().toStringRef()] = item.value().toStringRef();
    } else if (v.isString()) {  // format 1: "key=value key=value"
      std::istringstream is(v.toStringRef());
      for (std::string field; is >> field;) {
        const auto eq = field.find('=');
        if (eq != std::string::npos) config[field.substr(0, eq)] = field.substr(eq + 1);
      }
    } else {
      wrong("config", "a dictionary");
    }
    return config;
  }

  [[noreturn]] void missing(const std::string& entry) const {
    throw Error(path_ + ": the checkpoint has no entry " + entry + " (written by another program or version)");
  }
  [[noreturn]] void wrong(const std::string& entry, const std::string& expected) const {
    throw Error(path_ + ": entry " + entry + " is not " + expected);
  }

 private:
  std::string path_;
  torch::serialize::InputArchive archive_;
};

CheckpointState read_state(Reader& reader) {
  CheckpointState state;
  state.config = reader.config();
  state.epoch = reader.integer("epoch");
  state.epoch_step = reader.integer("epoch_step");
  state.global_step = reader.integer("global_step");
  state.history = reader.tensor(reader.archive(), "history", "history", /*is_buffer=*/true);
  if (state.history.dim() != 2 || state.history.scalar_type() != torch::kFloat)
    throw Error(reader.path() + ": entry history is " + shape_text(state.history) + ", expected a 2-d Float tensor");
  if (state.epoch < 0 || state.epoch_step < 0 || state.global_step < 0)
    throw Error(reader.path() + ": negative step counters (epoch " + std::to_string(state.epoch) + ", step " +
                std::to_string(state.global_step) + ")");
  return state;
}

// Copies the checkpoint's values into `module`'s parameters and buffers (their devices kept), after checking
// that each is there with the same shape and dtype. Module::save nests one archive per child module.
// Entries are named as state dicts name them: module/generator/deconv1.weight.
void load_module(Reader& reader, const std::string& entry, torch::serialize::InputArchive& archive,
                 torch::nn::Module& module, const std::string& prefix = "") {
  auto load = [&](const std::string& name, const torch::Tensor& target, bool is_buffer) {
    if (!target.defined()) return;
    const std::string full = entry + "/" + prefix + name;
    const torch::Tensor value = reader.tensor(archive, name, full, is_buffer);
    if (value.sizes() != target.sizes() || value.scalar_type() != target.scalar_type())
      throw Error(reader.path() + ": entry " + full + " is " + shape_text(value) + ", the model's is " +
                  shape_text(target) + " (a checkpoint of another model)");
    torch::NoGradGuard no_grad;
    target.copy_(value);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) load(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) load(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    auto sub = reader.sub(archive, child.key(), entry + "/" + prefix + child.key());
    load_module(reader, entry, sub, *child.value(), prefix + child.key() + ".");
  }
}

// Adam's archive (torch::optim::Adam and FusedAdam, which writes the same format) read into a scratch Adam
// over CPU stand-ins of the same parameters: each state tensor must have its parameter's shape and dtype.
void check_adam_state(Reader& reader, const std::string& entry, torch::serialize::InputArchive& archive,
                      torch::optim::Adam& optimizer) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<torch::Tensor> stand_ins;
  for (const auto& group : optimizer.param_groups()) {
    std::vector<torch::Tensor> params;
    for (const auto& p : group.params()) params.push_back(torch::empty(p.sizes(), p.options().device(torch::kCPU)));
    stand_ins.insert(stand_ins.end(), params.begin(), params.end());
    groups.emplace_back(params, group.options().clone());
  }
  torch::optim::Adam scratch(groups, static_cast<const torch::optim::AdamOptions&>(optimizer.defaults()));
  try {
    scratch.load(archive);
  } catch (const c10::Error& e) {
    throw Error(reader.path() + ": entry " + entry + " does not fit this optimiser (" + first_line(e) + ")");
  }
  for (const auto i : c10::irange(stand_ins.size())) {
    const auto& p = stand_ins[i];
    auto it = scratch.state().find(p.unsafeGetTensorImpl());
    if (it == scratch.state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
    for (const auto& [what, t] : {std::pair<const char*, torch::Tensor>{"exp_avg", s.exp_avg()},
                                  {"exp_avg_sq", s.exp_avg_sq()}, {"max_exp_avg_sq", s.max_exp_avg_sq()}}) {
      if (t.defined() && (t.sizes() != p.sizes() || t.scalar_type() != p.scalar_type()))
        throw Error(reader.path() + ": entry " + entry + " parameter " + std::to_string(i) + " " + what + " is " +
                    shape_text(t) + ", the parameter is " + shape_text(p) + " (a checkpoint of another model)");
    }
  }
}

// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_text() { return std::strerror(errno); }

void fsync_folder(const fs::path& folder) {
  Fd dir{::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY)};
  if (dir.fd >= 0) ::fsync(dir.fd);  // best effort: some file systems refuse fsync on folders
}

// The global step of a checkpoint-<step>.pt name beside `path`, or -1 for other names.
int64_t numbered_step(const fs::path& path, const fs::path& candidate) {
  const std::string stem = path.stem().string() + "-", name = candidate.filename().string();
  const std::string ext = path.extension().string();
  if (name.size() <= stem.size() + ext.size() || name.rfind(stem, 0) != 0 ||
      name.compare(name.size() - ext.size(), ext.size(), ext) != 0)
    return -1;
  const std::string digits = name.substr(stem.size(), name.size() - stem.size() - ext.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 18) return -1;
  return std::stoll(digits);
}

}  // namespace

std::string numbered_checkpoint(const std::string& path, int64_t global_step) {
  const fs::path p(path);
  char step[24];
  std::snprintf(step, sizeof step, "-%08lld", static_cast<long long>(global_step));
  return (p.parent_path() / (p.stem().string() + step + p.extension().string())).string();
}

void save_checkpoint(const std::string& path, const CheckpointState& state, const NamedModules& modules,
                     const NamedOptimizers& optimizers, torch::Device device, int64_t keep) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string(kFormat)));
  c10::Dict<std::string, std::string> config;
  for (const auto& [key, value] : state.config) config.insert(key, value);
  archive.write("config", c10::IValue(config));
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
  const fs::path target(path), folder = target.parent_path();
  std::error_code ec;
  if (!folder.empty()) fs::create_directories(folder, ec);
  // A name no other writer uses (a second process on the same --out, a stale file of a crash).
  static std::atomic<uint64_t> counter{std::random_device{}()};
  std::string temporary;
  Fd file;
  for (int attempt = 0; file.fd < 0 && attempt < 100; ++attempt) {
    temporary = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    file.fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (file.fd < 0 && errno != EEXIST) throw Error(path + ": cannot write a checkpoint here (" + errno_text() + ")");
  }
  if (file.fd < 0) throw Error(path + ": cannot create a temporary file beside it");
  int write_errno = 0;
  try {
    archive.save_to([&](const void* data, size_t size) -> size_t {
      const char* p = static_cast<const char*>(data);
      for (size_t left = size; left > 0 && write_errno == 0;) {
        const ssize_t n = ::write(file.fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) write_errno = errno;
        else p += n, left -= static_cast<size_t>(n);
      }
      return write_errno == 0 ? size : 0;
    });
  } catch (const c10::Error&) {
    if (write_errno == 0) write_errno = EIO;
  }
  if (write_errno == 0 && ::fsync(file.fd) != 0) write_errno = errno;
  if (write_errno != 0) {
    ::unlink(temporary.c_str());
    throw Error(path + ": cannot write checkpoint (" + std::strerror(write_errno) + ")");
  }
  if (keep > 1) {
    // The numbered name first (a hard link: the same file), then the rename that publishes it.
    const std::string numbered = numbered_checkpoint(path, state.global_step);
    ::unlink(numbered.c_str());
    if (::link(temporary.c_str(), numbered.c_str()) != 0) {
      fs::copy_file(temporary, numbered, fs::copy_options::overwrite_existing, ec);
      if (ec) {
        ::unlink(temporary.c_str());
        throw Error(numbered + ": cannot write checkpoint (" + ec.message() + ")");
      }
    }
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {  // atomic: readers see the old or the new file
    const std::string why = errno_text();
    ::unlink(temporary.c_str());
    throw Error(path + ": cannot replace checkpoint (" + why + ")");
  }
  if (keep > 1) {
    std::vector<std::pair<int64_t, fs::path>> numbered;
    for (const auto& entry : fs::directory_iterator(folder.empty() ? fs::path(".") : folder, ec)) {
      const int64_t step = numbered_step(target, entry.path());
      if (step >= 0) numbered.emplace_back(step, entry.path());
    }
    std::sort(numbered.rbegin(), numbered.rend());
    for (size_t i = static_cast<size_t>(keep); i < numbered.size(); ++i) ::unlink(numbered[i].second.c_str());
  }
  fsync_folder(folder);
}

CheckpointState read_checkpoint_state(const std::string& path) {
  Reader reader(path);
  return read_state(reader);
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
  Reader reader(path);
  auto state = read_state(reader);
  require_config(path, state.config, expected);
  for (const auto& [name, module] : modules) {
    auto sub = reader.sub(reader.archive(), "module/" + name, "module/" + name);
    load_module(reader, "module/" + name, sub, *module);
  }
  for (const auto& [name, optimizer] : optimizers) {
    const std::string entry = "optimizer/" + name;
    auto sub = reader.sub(reader.archive(), entry, entry);
    if (auto* adam = dynamic_cast<torch::optim::Adam*>(optimizer)) check_adam_state(reader, entry, sub, *adam);
    try {
      optimizer->load(sub);
    } catch (const c10::Error& e) {
      throw Error(path + ": entry " + entry + " does not fit this optimiser (" + first_line(e) + ")");
    }
  }
  if (restore_rng) {
    try {
      torch::Tensor cpu_state = reader.tensor(reader.archive(), "rng/cpu", "rng/cpu", /*is_buffer=*/true);
      auto cpu = at::globalContext().defaultGenerator(torch::kCPU);
      {
        std::lock_guard<std::mutex> lock(cpu.mutex());
        cpu.set_state(cpu_state);
      }
      torch::Tensor cuda_state;
      if (device.is_cuda() && reader.archive().try_read("rng/cuda", cuda_state, /*is_buffer=*/true)) {
        auto gen = default_generator(device);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(cuda_state);
      }
    } catch (const c10::Error& e) {
      throw Error(path + ": entry rng/* is not a random number generator state (" + first_line(e) + ")");
    }
  }
  return state;
}

}  // namespace hierpar::examples
