// A 32-bit value in mapped pinned host memory that a CUDA stream waits for (cuStreamWaitValue32): host work that
// the device needs (host averaging's sums) sets it when done, and the stream goes on from there, so the thread
// that queued the device's work never waits for the device. Private to the strategy library.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>

namespace hierpar::strategy {

class HostFlag {
 public:
  // Whether streams of `device` can wait on host memory (stream memory operations; a CUDA build on a driver and
  // GPU that offer them). Without, callers keep the host waiting for the device instead.
  static bool available(const c10::Device& device);

  HostFlag();  // the value starts at 0
  ~HostFlag();
  HostFlag(const HostFlag&) = delete;
  HostFlag& operator=(const HostFlag&) = delete;

  // Work queued on `stream` after this waits until the value is >= `value` (a wrapping counter is not needed:
  // 2^32 steps).
  void enqueue_wait(const c10::Stream& stream, uint32_t value) const;
  // Publishes `value` after every host write made before this call (a release store).
  void set(uint32_t value);

 private:
  uint32_t* value_ = nullptr;
  uintptr_t device_address_ = 0;  // the same memory as the device sees it
};

}  // namespace hierpar::strategy
