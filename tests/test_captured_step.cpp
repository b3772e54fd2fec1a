// CapturedStep (hierpar/strategy/captured_step.h): after a capture that CUDA ended as invalid, the device's random
// generator and memory are as before it, so eager work and a new capture go on; a replay draws the right random
// numbers while the side stream lags behind the host. Needs a GPU; skips without one.
#include "testing.h"

#include "hierpar/strategy/captured_step.h"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <stdexcept>

namespace hs = hierpar::strategy;

namespace {
int64_t reserved_bytes(c10::DeviceIndex device) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device).reserved_bytes[0].current;
}
}  // namespace

// A capture whose body draws random numbers, allocates 64 MB and then breaks the capture (a device-wide
// synchronisation is not allowed while capturing, as the allocator's own out-of-memory path can do) throws; after it
// the generator draws what it would have without the capture, the graph's memory goes back with emptyCache(), and a
// second capture replays.
TEST(CapturedStepCuda, FailedCaptureLeavesGeneratorAndMemoryAsBefore) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  const auto on_device = torch::TensorOptions().device(device);
  torch::manual_seed(11);
  const torch::Tensor expected = torch::rand({4096}, on_device);

  torch::manual_seed(11);
  hs::CapturedStep step(device);
  step.warm_up([&] { (void)torch::rand({16}, on_device); });
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  const int64_t reserved_before = reserved_bytes(0);
  torch::manual_seed(11);
  EXPECT_THROW(step.capture([&] {
                 const torch::Tensor in_capture = torch::rand({4096}, on_device);
                 const torch::Tensor large = torch::empty({16 << 20}, on_device);
                 (void)cudaDeviceSynchronize();  // invalidates the capture
                 (void)cudaGetLastError();
                 throw std::runtime_error("the step failed while capturing");
               }),
               std::runtime_error);
  EXPECT_FALSE(step.captured());

  const torch::Tensor drawn = torch::rand({4096}, on_device);
  EXPECT_TRUE(torch::equal(drawn, expected)) << "the generator's seed and offset after the failed capture";
  c10::cuda::CUDACachingAllocator::emptyCache();
  EXPECT_EQ(reserved_bytes(0), reserved_before) << "the failed capture's memory pool was not released";

  torch::Tensor out = torch::zeros({4096}, on_device);
  step.capture([&] { out.copy_(torch::rand({4096}, on_device)); });
  ASSERT_TRUE(step.captured());
  step.replay(0);
  torch::cuda::synchronize();
  EXPECT_GT(out.sum().item<float>(), 1000.f) << "the second capture replayed (uniform numbers: about 2048)";
}

// The capture's start resets the generator's graph offset with eager work on the side stream; a replay sets the
// offset on its own stream and then draws. With the side stream still busy (as when the GPU runs far behind the
// host), its reset must not land between the two: here it would, deterministically, since the replayed graph waits
// before drawing while the side stream's reset comes due. The replay then drew the seed's first numbers again.
TEST(CapturedStepCuda, ReplayDrawsAfterALaggingSideStreamsReset) {
  HIERPAR_REQUIRE_CUDA();
  const torch::Device device(torch::kCUDA, 0);
  const auto on_device = torch::TensorOptions().device(device);
  c10::cuda::CUDAGuard device_guard(device);
  constexpr int64_t kCycles = 50'000'000;  // some 25 ms at 2 GHz
  torch::manual_seed(5);
  const torch::Tensor first = torch::randn({4096}, on_device);
  const torch::Tensor second = torch::randn({4096}, on_device);

  torch::manual_seed(5);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  hs::CapturedStep step(device, side);
  torch::Tensor out = torch::empty({4096}, on_device);
  step.warm_up([&] { out.copy_(torch::randn({4096}, on_device)); });  // draws `first`
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    at::cuda::sleep(kCycles);  // the side stream lags: the capture's offset reset waits behind this
  }
  step.capture([&] {
    at::cuda::sleep(4 * kCycles);  // the replay's draw comes after the side stream's reset is due
    out.copy_(torch::randn({4096}, on_device));
  });
  step.replay(0);
  torch::cuda::synchronize();
  EXPECT_FALSE(torch::equal(out, first)) << "the replay drew at the offset the capture's start reset";
  EXPECT_TRUE(torch::equal(out, second)) << "the replay draws what the second eager draw did";
}
