// Shared test helpers: a printed per-run seed, dtype tolerances, comparison with context, CUDA skips, a small DCGAN.
#pragma once

#include "hierpar/models/dcgan.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace hierpar::testing {

// Sets cuDNN's algorithm choice (deterministic, benchmark) and, where given, TF32 for convolutions and matmuls, for
// the guard's lifetime, and puts back what was set before, failures included: tests that share a process must not
// run under each other's settings.
class CudnnSettings {
 public:
  CudnnSettings(bool deterministic, bool benchmark, std::optional<bool> tf32 = std::nullopt);
  ~CudnnSettings();
  CudnnSettings(const CudnnSettings&) = delete;
  CudnnSettings& operator=(const CudnnSettings&) = delete;

 private:
  bool deterministic_, benchmark_, tf32_cudnn_, tf32_cublas_;
};

// The seed of this run: HIERPAR_TEST_SEED if set, else drawn fresh; printed once at start-up.
uint64_t run_seed();

// A generator for shapes and parameters, seeded from the run seed and the current test's name, so
// one failing test reproduces alone with HIERPAR_TEST_SEED=<printed seed>. Also seeds torch.
std::mt19937_64& rng();
int64_t rand_int(int64_t lo, int64_t hi);  // inclusive
bool coin();

// Relative and absolute tolerances for comparing a result in `dtype` with a float64 reference:
// float64 1e-10, float32 1e-5 (summation order only), tf32 matmul 2e-3, bf16 2e-2, fp16 4e-3 (relative
// to the reference's scale). Each is a few units of the dtype's rounding error.
struct Tolerance {
  double rtol, atol;
};
Tolerance tolerance_for(c10::ScalarType dtype);

// Expects `actual` to match `expected` elementwise (NaNs in the same places, infinities equal),
// reporting the worst element. Both are compared in float64 on the CPU.
void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, Tolerance tol,
                  const std::string& what);
inline void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  expect_close(actual, expected, tolerance_for(actual.scalar_type()), what);
}

// Random data in [-1, 1) (never zeros), in `dtype` on `device`, optionally channels_last or as a
// non-contiguous view (every other element of a wider tensor).
enum class Layout { contiguous, channels_last, strided };
torch::Tensor random_tensor(at::IntArrayRef sizes, const torch::TensorOptions& options,
                            Layout layout = Layout::contiguous);
const char* to_string(Layout layout);

bool cuda_available();

// The names of the operators `f` dispatches on this thread (a RecordFunction callback), in order: which route a call
// took, observed rather than inferred from its results.
std::vector<std::string> dispatched_operators(const std::function<void()>& f);

// The seed's DCGAN at its smallest (32x32, a quarter of the width): milliseconds a training step on the CPU.
hierpar::models::DCGANOptions small_dcgan(hierpar::LayerSet layers, int64_t nz = 8, int64_t channels = 3);

// A BatchNormSync that normalises with this replica's own statistics: installed, it makes a layer take the
// synchronized path (for tests of what refuses it).
struct LocalBatchNormSync final : hierpar::nn::BatchNormSync {
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& weight, const torch::Tensor& bias,
                        const torch::Tensor& running_mean, const torch::Tensor& running_var, double momentum,
                        double eps) override {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, true, momentum, eps, false);
  }
};

// The most CUDA memory allocated at once, above what was allocated before, by one G and D forward and backward of
// the DCGAN `model` on cuda:0 at `batch`, after `warmup` untimed passes (one-time allocations, an offload plan);
// with `mark_steps` each pass, the measured one too, starts with begin_offload_step as the trainer's steps do.
int64_t dcgan_pass_peak_bytes(const hierpar::models::DCGANOptions& model, int64_t batch, int warmup, bool mark_steps);

}  // namespace hierpar::testing

// Skips a CUDA test on a machine without a GPU, saying why; a skip is reported as a skip, not a pass.
#define HIERPAR_REQUIRE_CUDA()                                                        \
  do {                                                                                \
    if (!::hierpar::testing::cuda_available())                                        \
      GTEST_SKIP() << "no CUDA device on this machine: this test runs on the GPU check"; \
  } while (0)

// Skips a test that places work on two GPUs where there are fewer.
#define HIERPAR_REQUIRE_TWO_GPUS()                                                   \
  do {                                                                               \
    HIERPAR_REQUIRE_CUDA();                                                          \
    if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";             \
  } while (0)

// Expects `statement` to throw a c10::Error whose message contains `substring`.
#define HIERPAR_EXPECT_THROW_MSG(statement, substring)                                            \
  do {                                                                                            \
    try {                                                                                         \
      statement;                                                                                  \
      ADD_FAILURE() << "expected an error containing \"" << (substring) << "\", got none";        \
    } catch (const c10::Error& e) {                                                               \
      EXPECT_NE(std::string(e.what_without_backtrace()).find(substring), std::string::npos)       \
          << "error message was: " << e.what_without_backtrace();                                 \
    }                                                                                             \
  } while (0)
