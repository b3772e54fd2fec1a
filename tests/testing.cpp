#include "testing.h"

#include "hierpar/enum_names.h"

#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdlib>
#include <functional>
#include <iostream>

namespace hierpar::testing {

CudnnSettings::CudnnSettings(bool deterministic, bool benchmark, std::optional<bool> tf32)
    : deterministic_(at::globalContext().deterministicCuDNN()),
      benchmark_(at::globalContext().benchmarkCuDNN()),
      tf32_cudnn_(at::globalContext().allowTF32CuDNN()),
      tf32_cublas_(at::globalContext().allowTF32CuBLAS()) {
  at::globalContext().setDeterministicCuDNN(deterministic);
  at::globalContext().setBenchmarkCuDNN(benchmark);
  if (tf32) {
    at::globalContext().setAllowTF32CuDNN(*tf32);
    at::globalContext().setAllowTF32CuBLAS(*tf32);
  }
}

CudnnSettings::~CudnnSettings() {
  at::globalContext().setDeterministicCuDNN(deterministic_);
  at::globalContext().setBenchmarkCuDNN(benchmark_);
  at::globalContext().setAllowTF32CuDNN(tf32_cudnn_);
  at::globalContext().setAllowTF32CuBLAS(tf32_cublas_);
}

uint64_t run_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("HIERPAR_TEST_SEED");
    return env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  }();
  return seed;
}

std::mt19937_64& rng() {
  static std::mt19937_64 gen;
  static std::string seeded_for;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  if (name != seeded_for) {
    seeded_for = name;
    uint64_t s = run_seed() ^ std::hash<std::string>{}(name);
    gen.seed(s);
    torch::manual_seed(s);
  }
  return gen;
}

int64_t rand_int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng()); }
bool coin() { return rand_int(0, 1) == 1; }

Tolerance tolerance_for(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kDouble: return {1e-10, 1e-12};
    case torch::kFloat: return {1e-5, 1e-6};
    case torch::kBFloat16: return {2e-2, 2e-2};
    case torch::kHalf: return {4e-3, 4e-3};
    default: return {0, 0};
  }
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, Tolerance tol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what << ": shapes differ";
  auto a = actual.detach().to(torch::kCPU, torch::kDouble);
  auto e = expected.detach().to(torch::kCPU, torch::kDouble);
  auto nan_a = a.isnan(), nan_e = e.isnan();
  ASSERT_TRUE(nan_a.equal(nan_e)) << what << ": NaN positions differ (" << nan_a.sum().item<int64_t>()
                                  << " NaN in result, " << nan_e.sum().item<int64_t>() << " expected)";
  auto finite = ~nan_e;
  auto diff = (a - e).abs().masked_fill(~finite, 0).nan_to_num(0.0, 0.0, 0.0);
  auto inf_mismatch = (a.isinf() | e.isinf()) & (a != e);
  ASSERT_FALSE(inf_mismatch.any().item<bool>()) << what << ": infinities differ";
  auto limit = tol.atol + tol.rtol * e.abs().masked_fill(~finite, 0).nan_to_num(0.0, 0.0, 0.0);
  auto bad = diff > limit;
  if (bad.any().item<bool>()) {
    auto idx = (diff - limit).flatten().argmax().item<int64_t>();
    ADD_FAILURE() << what << ": " << bad.sum().item<int64_t>() << " of " << e.numel()
                  << " elements off; worst at flat index " << idx << ": got " << a.flatten()[idx].item<double>()
                  << ", expected " << e.flatten()[idx].item<double>() << " (rtol " << tol.rtol << ", atol "
                  << tol.atol << ", seed " << run_seed() << ")";
  }
}

torch::Tensor random_tensor(at::IntArrayRef sizes, const torch::TensorOptions& options, Layout layout) {
  rng();  // seeds torch for this test
  auto make = [&](at::IntArrayRef s) {
    return torch::rand(s, torch::TensorOptions().dtype(torch::kDouble)).mul_(2).sub_(1).to(options);
  };
  switch (layout) {
    case Layout::contiguous: return make(sizes);
    case Layout::channels_last:
      return sizes.size() == 4 ? make(sizes).contiguous(torch::MemoryFormat::ChannelsLast) : make(sizes);
    case Layout::strided: {
      std::vector<int64_t> wide(sizes.begin(), sizes.end());
      wide.back() *= 2;
      return make(wide).slice(-1, 0, wide.back(), 2);
    }
  }
  return make(sizes);
}

const char* to_string(Layout layout) {
  constexpr EnumNames<Layout, 3> names{
      {{Layout::contiguous, "contiguous"}, {Layout::channels_last, "channels_last"}, {Layout::strided, "strided"}}};
  return name_of(names, layout);
}

bool cuda_available() { return torch::cuda::is_available(); }

namespace {
thread_local std::vector<std::string>* dispatched = nullptr;

std::unique_ptr<at::ObserverContext> note_operator(const at::RecordFunction& fn) {
  if (dispatched != nullptr) dispatched->emplace_back(fn.name());
  return nullptr;
}
}  // namespace

std::vector<std::string> dispatched_operators(const std::function<void()>& f) {
  std::vector<std::string> names;
  dispatched = &names;
  const auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&note_operator));
  try {
    f();
  } catch (...) {
    at::removeCallback(handle);
    dispatched = nullptr;
    throw;
  }
  at::removeCallback(handle);
  dispatched = nullptr;
  return names;
}

hierpar::models::DCGANOptions small_dcgan(hierpar::LayerSet layers, int64_t nz, int64_t channels) {
  hierpar::models::DCGANOptions model;
  model.image_size = 32;
  model.width = 0.25;
  model.nz = nz;
  model.channels = channels;
  model.layers = layers;
  return model;
}

int64_t dcgan_pass_peak_bytes(const hierpar::models::DCGANOptions& model, int64_t batch, int warmup, bool mark_steps) {
  torch::manual_seed(0);
  hierpar::models::Generator g(model);
  hierpar::models::Discriminator d(model);
  g->to(torch::kCUDA);
  d->to(torch::kCUDA);
  const auto z = torch::randn({batch, model.nz, 1, 1}, torch::kCUDA);
  auto mark = [&] {
    if (mark_steps) hierpar::nn::begin_offload_step(torch::Device(torch::kCUDA, 0));
  };
  auto pass = [&] { d->forward(g->forward(z)).square().mean().backward(); };
  for (int i = 0; i < warmup; ++i) {
    mark();
    pass();
  }
  mark();  // before the peak statistics restart: a plan made now reads the last pass's peak
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  pass();
  torch::cuda::synchronize();
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
}

}  // namespace hierpar::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  setenv("HIERPAR_POISON_OUTPUTS", "1", 0);  // kernels fill outputs with NaN first: unwritten elements show
  std::cout << "hierpar tests: HIERPAR_TEST_SEED=" << hierpar::testing::run_seed()
            << (hierpar::testing::cuda_available() ? " (CUDA available)" : " (no CUDA device)") << std::endl;
  return RUN_ALL_TESTS();
}
