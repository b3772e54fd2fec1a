#pragma once
// How a training step computes, as one value (like Placement): parsed and validated once, printed as it is, and
// applied as a scope.
//   fp32: float32 throughout (on CUDA without TF32);
//   tf32: float32 with TF32 tensor-core convolutions and matmuls on CUDA (the CPU computes float32);
//   bf16: autocast to bfloat16 on CUDA (weights, optimiser and BatchNorm statistics stay float32), channels_last.
// channels_last: parameters and batches in channels_last (bf16 always).
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <ostream>
#include <string>

namespace hierpar::strategy {

struct StepPrecision {
  enum class Math { fp32, tf32, bf16 };
  Math math = Math::fp32;
  bool channels_last = false;

  // From the flags --precision fp32|tf32|bf16 and --channels-last, for a step on `device`; throws c10::Error naming
  // the flag (an unknown name, bf16 off CUDA). TF32 is a CUDA mode: "tf32" on the CPU is float32.
  static StepPrecision from_flags(const std::string& precision, bool channels_last, c10::DeviceType device);

  bool tf32() const { return math != Math::fp32; }  // float32 convolutions and matmuls may use TF32
  std::optional<c10::ScalarType> autocast_dtype() const;
  const char* name() const;    // "fp32", "tf32" or "bf16"
  const char* layout() const;  // "channels_last" or "nchw"
  std::string to_string() const;  // e.g. "bf16 autocast, channels_last" or "fp32 with TF32"
};

std::ostream& operator<<(std::ostream& os, const StepPrecision& precision);

// ATen's TF32 switches (cuDNN convolutions, cuBLAS matmuls) as `precision` says while alive; restored after.
class PrecisionScope {
 public:
  explicit PrecisionScope(const StepPrecision& precision);
  ~PrecisionScope();
  PrecisionScope(const PrecisionScope&) = delete;
  PrecisionScope& operator=(const PrecisionScope&) = delete;

 private:
  bool cudnn_tf32_, cublas_tf32_;
};

}  // namespace hierpar::strategy
