#pragma once
// The operators' kernel-path switches, declared in one place. Each names a fast path or a route that is on unless
// switched off (poison_outputs: off unless switched on), for same-process A/B timings, bisecting and tests.
//
// Read one way: switch_on(Switch). A switch's value is, in order: the innermost SwitchScope alive for it (any
// thread), else its environment variable (HIERPAR_<NAME>=0 or 1, read once per process), else its default.
// Tests and benchmarks flip switches with SwitchScope, never with setenv (the environment is not thread-safe).
//
// The two numeric knobs (K4S2P1_SPLIT_TARGET, MAX_SMEM_PER_BLOCK) are read from the environment once per process.
#include <cstdint>
#include <optional>
#include <vector>

namespace hierpar {

enum class Switch : int {
  cpu_aten,                // CPU float32/float64 calls run on ATen's CPU kernels (off: hierpar's reference kernels)
  side_stream,             // conv_transpose2d's backward runs grad_input and grad_weight on two streams
  bn_cluster,              // batch_norm_act: mid-size shapes on the cluster path (off: cooperative split)
  k4s2p1_tma,              // the k4s2p1 GEMMs load tiles by TMA on Hopper (off: cp.async)
  k4s2p1_weight_in_place,  // channels_last k4s2p1 weights are read in place (off: packed first)
  wgmma,                   // Hopper's wgmma kernels for k4s2p1 (off: mma.sync)
  wgmma_all_phases,        // wgmma for every phase of the k4s2p1 forward
  wgmma_grad_input_patch,  // wgmma for the k4s2p1 grad_input patch GEMM
  layer_routing,           // hierpar::nn's convolutions take ATen's where hierpar's kernels lose (hierpar/routing.h)
  poison_outputs,          // outputs filled with NaN (or -1 / 255) before kernels write them (tests)
};

struct SwitchInfo {
  Switch which;
  const char* variable;  // the environment variable
  bool default_on;
  const char* meaning;
};

// Every switch, in declaration order.
const std::vector<SwitchInfo>& switches();

bool switch_on(Switch which);

// Sets `which` to `on` while alive, restoring what was there before. Scopes nest; they are process-wide, so a
// test that runs kernels on other threads meanwhile sees the override too.
class SwitchScope {
 public:
  SwitchScope(Switch which, bool on);
  ~SwitchScope();
  SwitchScope(const SwitchScope&) = delete;
  SwitchScope& operator=(const SwitchScope&) = delete;

 private:
  Switch which_;
  int previous_;
};

enum class Knob : int {
  k4s2p1_split_target,  // HIERPAR_K4S2P1_SPLIT_TARGET=1..4: k4s2p1 plans K splits for that many CTAs per SM
  max_smem_per_block,   // HIERPAR_MAX_SMEM_PER_BLOCK=bytes: the routing assumes at most that opt-in shared memory
};

// The knob's value from the environment, checked against its range (an error names the variable), or nullopt.
std::optional<int64_t> knob(Knob which);

}  // namespace hierpar
