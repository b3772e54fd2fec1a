// Command-line plumbing of the example programs: a small flag parser, a progress bar, and the one-line
// error reporting every failure goes through.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hierpar::examples {

// A user-facing failure (bad flag, unreadable data, mismatched checkpoint): what() is one line, printed as
// "<program>: error: <what>" with a non-zero exit status.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs body() and turns any exception into one line on stderr: returns body()'s status, 2 for an Error
// thrown by flag parsing (FlagError), 1 for any other failure. A FlagError's line points to
// `<help_command> --help` (default: the program's own help; a subcommand passes "<program> <command>").
int run_reporting_errors(const std::string& program, const std::function<int()>& body,
                         const std::string& help_command = "");

struct FlagError : Error {
  using Error::Error;
};

// A double as messages and stored configurations print it: std::ostream's default, 6 significant digits.
std::string format_number(double v);

// Creates `folder` if needed and checks that a file can be written there; throws Error naming `flag` otherwise.
void require_writable_folder(const std::string& flag, const std::string& folder);

// "--name value" or "--name=value"; booleans are "--name". parse() throws FlagError naming the flag for an
// unknown flag, a missing value or one that does not parse or is out of range.
class Flags {
 public:
  explicit Flags(std::string command) : command_(std::move(command)) {}
  Flags& add(const std::string& name, std::string* target, const std::string& help);
  Flags& add(const std::string& name, int64_t* target, const std::string& help, int64_t min_value);
  Flags& add(const std::string& name, double* target, const std::string& help, double min_exclusive);
  Flags& add(const std::string& name, bool* target, const std::string& help);
  // A flag whose value may be left out ("--name" alone sets `implicit`; "--name V" or "--name=V" sets V).
  Flags& add_optional(const std::string& name, std::string* target, const std::string& implicit, const std::string& help);
  // argv[first..argc) are the flags. Returns false when --help was given (usage printed to stdout).
  bool parse(int argc, char** argv, int first);
  // True if the flag appeared on the command line.
  bool given(const std::string& name) const;
  std::string usage() const;

 private:
  struct Flag {
    std::string name, help, default_text;
    bool is_bool = false;
    std::function<void(const std::string&)> set;
    std::string implicit;  // add_optional: the value of the flag given alone
  };
  std::string command_;
  std::vector<Flag> flags_;
  std::vector<std::string> given_;
};

// A progress line on stderr: step/total, steps/s, images/s and named values, redrawn in place with \r on
// a terminal, printed as plain lines (at most every `plain_interval_s`) otherwise.
class Progress {
 public:
  // `first_step` steps were done before this Progress started (a resumed epoch): the rates count from there.
  Progress(std::string label, int64_t total_steps, int64_t images_per_step, double plain_interval_s = 10.0,
           int64_t first_step = 0);
  // `step` counts from the start of the epoch (1-based); values are shown as name=value.
  void update(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // Ends the line (terminal) and prints the summary of the last update.
  void finish();

 private:
  std::string render(int64_t step, const std::vector<std::pair<std::string, double>>& values, bool bar) const;
  std::string label_;
  int64_t total_, images_per_step_, first_step_;
  double plain_interval_s_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_plain_;
  int64_t last_step_ = 0, printed_step_ = 0;
  std::vector<std::pair<std::string, double>> last_values_;
};

}  // namespace hierpar::examples
