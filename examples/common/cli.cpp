#include "common/cli.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <fcntl.h>
#include <unistd.h>

namespace hierpar::examples {

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

int run_reporting_errors(const std::string& program, const std::function<int()>& body,
                         const std::string& help_command) {
  auto first_line = [](std::string s) {
    const auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  };
  try {
    return body();
  } catch (const FlagError& e) {
    std::cerr << program << ": error: " << e.what() << " (see " << (help_command.empty() ? program : help_command)
              << " --help)\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << program << ": error: " << first_line(e.what_without_backtrace()) << "\n";
  } catch (const std::exception& e) {
    std::cerr << program << ": error: " << first_line(e.what()) << "\n";
  }
  return 1;
}

void require_writable_folder(const std::string& flag, const std::string& folder) {
  std::error_code ec;
  // create_directories would only say "File exists" for a file in the folder's place.
  if (std::filesystem::exists(folder, ec) && !std::filesystem::is_directory(folder, ec))
    throw Error(flag + " " + folder + ": is a file, not a folder (give a folder for the output)");
  std::filesystem::create_directories(folder, ec);
  if (ec) throw Error(flag + " " + folder + ": cannot create this folder (" + ec.message() + ")");
  const std::string probe = folder + "/.write-test-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const bool written = fd >= 0 && ::write(fd, "x", 1) == 1;
  const int saved = errno;
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
  }
  if (!written) throw Error(flag + " " + folder + ": cannot write files there (" + std::strerror(saved) + ")");
}

Flags& Flags::add(const std::string& name, std::string* target, const std::string& help) {
  flags_.push_back({name, help, *target, false, [target](const std::string& v) { *target = v; }});
  return *this;
}

Flags& Flags::add(const std::string& name, int64_t* target, const std::string& help, int64_t min_value) {
  flags_.push_back({name, help, std::to_string(*target), false, [=](const std::string& v) {
                      errno = 0;
                      char* end = nullptr;
                      const long long parsed = std::strtoll(v.c_str(), &end, 10);
                      if (v.empty() || *end != '\0' || errno == ERANGE)
                        throw FlagError("--" + name + ": expected an integer, got '" + v + "'");
                      if (parsed < min_value)
                        throw FlagError("--" + name + ": expected an integer >= " + std::to_string(min_value) +
                                        ", got " + v);
                      *target = parsed;
                    }});
  return *this;
}

Flags& Flags::add(const std::string& name, double* target, const std::string& help, double min_exclusive) {
  std::ostringstream def;
  def << *target;
  flags_.push_back({name, help, def.str(), false, [=](const std::string& v) {
                      errno = 0;
                      char* end = nullptr;
                      const double parsed = std::strtod(v.c_str(), &end);
                      if (v.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(parsed))
                        throw FlagError("--" + name + ": expected a number, got '" + v + "'");
                      if (!(parsed > min_exclusive)) {
                        std::ostringstream os;
                        os << "--" << name << ": expected a number > " << min_exclusive << ", got " << v;
                        throw FlagError(os.str());
                      }
                      *target = parsed;
                    }});
  return *this;
}

Flags& Flags::add(const std::string& name, bool* target, const std::string& help) {
  flags_.push_back({name, help, "", true, [target](const std::string&) { *target = true; }});
  return *this;
}

Flags& Flags::add_optional(const std::string& name, std::string* target, const std::string& implicit,
                           const std::string& help) {
  flags_.push_back({name, help, *target, false, [target](const std::string& v) { *target = v; }, implicit});
  return *this;
}

bool Flags::parse(int argc, char** argv, int first) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << usage();
      return false;
    }
    if (arg.rfind("--", 0) != 0) throw FlagError("unexpected argument '" + arg + "' (flags start with --)");
    std::string name = arg.substr(2), value;
    const auto eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto flag = std::find_if(flags_.begin(), flags_.end(), [&](const Flag& f) { return f.name == name; });
    if (flag == flags_.end()) throw FlagError("unknown flag --" + name + " for '" + command_ + "'");
    if (flag->is_bool) {
      if (has_value) throw FlagError("--" + name + " takes no value");
    } else if (!has_value && !flag->implicit.empty() &&
               (i + 1 >= argc || std::string(argv[i + 1]).rfind("--", 0) == 0)) {
      value = flag->implicit;
    } else if (!has_value) {
      if (i + 1 >= argc) throw FlagError("--" + name + ": missing value");
      value = argv[++i];
    }
    flag->set(value);
    given_.push_back(name);
  }
  return true;
}

bool Flags::given(const std::string& name) const {
  return std::find(given_.begin(), given_.end(), name) != given_.end();
}

std::string Flags::usage() const {
  std::ostringstream os;
  os << "usage: " << command_ << " [flags]\n";
  for (const auto& f : flags_) {
    std::string head = "  --" + f.name + (f.is_bool ? "" : f.implicit.empty() ? " V" : " [V]");
    os << head << std::string(head.size() < 26 ? 26 - head.size() : 1, ' ') << f.help;
    // A help text that explains its own default is not followed by the raw one.
    if (!f.is_bool && !f.default_text.empty() && f.help.find("default") == std::string::npos)
      os << " (default " << f.default_text << ")";
    os << "\n";
  }
  return os.str();
}

Progress::Progress(std::string label, int64_t total_steps, int64_t images_per_step, double plain_interval_s,
                   int64_t first_step)
    : label_(std::move(label)),
      total_(total_steps),
      images_per_step_(images_per_step),
      first_step_(first_step),
      plain_interval_s_(plain_interval_s),
      tty_(isatty(fileno(stderr)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_plain_(start_) {}

std::string Progress::render(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                             bool bar) const {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double steps_per_s = seconds > 0 ? (step - first_step_) / seconds : 0.0;
  char buf[160];
  std::string out = label_ + " ";
  if (bar && total_ > 0) {
    const int width = 24, filled = static_cast<int>(width * std::min<int64_t>(step, total_) / total_);
    out += "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] ";
  }
  std::snprintf(buf, sizeof buf, "%lld/%lld  %.2f steps/s  %.1f images/s", static_cast<long long>(step),
                static_cast<long long>(total_), steps_per_s, steps_per_s * images_per_step_);
  out += buf;
  for (const auto& [name, value] : values) {
    std::snprintf(buf, sizeof buf, "  %s %.4f", name.c_str(), value);
    out += buf;
  }
  return out;
}

void Progress::update(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  last_step_ = step;
  last_values_ = values;
  if (tty_) {
    std::cerr << "\r" << render(step, values, true) << "\033[K" << std::flush;
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_plain_).count() >= plain_interval_s_ || step == total_) {
    last_plain_ = now;
    printed_step_ = step;
    std::cerr << render(step, values, false) << "\n";
  }
}

void Progress::finish() {
  if (tty_) {
    std::cerr << "\r" << render(last_step_, last_values_, true) << "\033[K\n";
  } else if (last_step_ != printed_step_) {
    std::cerr << render(last_step_, last_values_, false) << "\n";
  }
}

}  // namespace hierpar::examples
