#include "hierpar/switches.h"

#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>

namespace hierpar {
namespace {

constexpr size_t kSwitches = static_cast<size_t>(Switch::poison_outputs) + 1;

// Per switch, the SwitchScope override: 0 none (static storage starts at zero), 1 off, 2 on.
constexpr int kNone = 0, kOff = 1, kOn = 2;
std::array<std::atomic<int>, kSwitches> overrides{};

bool from_environment(const SwitchInfo& info) {
  const std::optional<bool> value = c10::utils::check_env(info.variable);
  return value.has_value() ? *value : info.default_on;
}

struct KnobRange {
  const char* variable;
  int64_t low, high;
  const char* expected;
};

std::optional<int64_t> read_knob(const KnobRange& range) {
  const std::optional<std::string> text = c10::utils::get_env(range.variable);
  if (!text.has_value() || text->empty()) return std::nullopt;
  char* end = nullptr;
  const long long value = std::strtoll(text->c_str(), &end, 10);
  TORCH_CHECK(end != nullptr && *end == '\0' && value >= range.low && value <= range.high, range.variable,
              ": expected ", range.expected, ", got '", *text, "'");
  return value;
}

}  // namespace

const std::vector<SwitchInfo>& switches() {
  static const std::vector<SwitchInfo> all{
      {Switch::cpu_aten, "HIERPAR_CPU_ATEN", true, "CPU float32/float64 calls on ATen's CPU kernels (docs/cpu.md)"},
      {Switch::side_stream, "HIERPAR_SIDE_STREAM", true, "conv_transpose2d backward on two streams"},
      {Switch::bn_cluster, "HIERPAR_BN_CLUSTER", true, "batch_norm_act's cluster path (docs/batch_norm_act.md)"},
      {Switch::k4s2p1_tma, "HIERPAR_K4S2P1_TMA", true, "k4s2p1 tiles loaded by TMA (docs/conv_transpose.md)"},
      {Switch::k4s2p1_weight_in_place, "HIERPAR_K4S2P1_WEIGHT_IN_PLACE", true,
       "channels_last k4s2p1 weights read in place"},
      {Switch::wgmma, "HIERPAR_WGMMA", true, "Hopper wgmma kernels for k4s2p1 (off: mma.sync)"},
      {Switch::wgmma_all_phases, "HIERPAR_WGMMA_ALL_PHASES", true, "wgmma for every k4s2p1 forward phase"},
      {Switch::wgmma_grad_input_patch, "HIERPAR_WGMMA_GRAD_INPUT_PATCH", true, "wgmma for the grad_input patch GEMM"},
      {Switch::layer_routing, "HIERPAR_LAYER_ROUTING", true,
       "hierpar::nn convolutions on ATen where hierpar's kernels lose (off: always hierpar's op)"},
      {Switch::poison_outputs, "HIERPAR_POISON_OUTPUTS", false, "outputs poisoned before kernels write them"},
  };
  return all;
}

bool switch_on(Switch which) {
  const auto index = static_cast<size_t>(which);
  const int forced = overrides[index].load(std::memory_order_relaxed);
  if (forced != kNone) return forced == kOn;
  static const std::array<bool, kSwitches> environment = [] {
    std::array<bool, kSwitches> values{};
    for (const SwitchInfo& info : switches()) values[static_cast<size_t>(info.which)] = from_environment(info);
    return values;
  }();
  return environment[index];
}

SwitchScope::SwitchScope(Switch which, bool on)
    : which_(which), previous_(overrides[static_cast<size_t>(which)].exchange(on ? kOn : kOff)) {}

SwitchScope::~SwitchScope() { overrides[static_cast<size_t>(which_)].store(previous_); }

std::optional<int64_t> knob(Knob which) {
  if (which == Knob::k4s2p1_split_target) {
    static const std::optional<int64_t> value = read_knob({"HIERPAR_K4S2P1_SPLIT_TARGET", 1, 4, "CTAs per SM, 1 to 4"});
    return value;
  }
  static const std::optional<int64_t> value =
      read_knob({"HIERPAR_MAX_SMEM_PER_BLOCK", 1, int64_t{1} << 30, "a number of bytes"});
  return value;
}

}  // namespace hierpar
