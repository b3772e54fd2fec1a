#include "hierpar/strategy/precision.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

namespace hierpar::strategy {

StepPrecision StepPrecision::from_flags(const std::string& precision, bool channels_last, c10::DeviceType device) {
  StepPrecision p;
  if (precision == "fp32") {
    p.math = Math::fp32;
  } else if (precision == "tf32") {
    p.math = device == c10::DeviceType::CUDA ? Math::tf32 : Math::fp32;
  } else if (precision == "bf16") {
    TORCH_CHECK(device == c10::DeviceType::CUDA, "--precision bf16 needs a CUDA device (this run is on the ",
                device == c10::DeviceType::CPU ? "CPU" : c10::DeviceTypeName(device), ")");
    p.math = Math::bf16;
  } else {
    TORCH_CHECK(false, "--precision: expected fp32, tf32 or bf16, got '", precision, "'");
  }
  p.channels_last = channels_last || p.math == Math::bf16;
  return p;
}

std::optional<c10::ScalarType> StepPrecision::autocast_dtype() const {
  return math == Math::bf16 ? std::optional<c10::ScalarType>(c10::kBFloat16) : std::nullopt;
}

const char* StepPrecision::name() const {
  switch (math) {
    case Math::fp32: return "fp32";
    case Math::tf32: return "tf32";
    case Math::bf16: return "bf16";
  }
  return "?";
}

const char* StepPrecision::layout() const { return channels_last ? "channels_last" : "nchw"; }

std::string StepPrecision::to_string() const {
  std::string s = math == Math::bf16 ? "bf16 autocast" : math == Math::tf32 ? "fp32 with TF32" : "fp32";
  if (channels_last) s += ", channels_last";
  return s;
}

std::ostream& operator<<(std::ostream& os, const StepPrecision& precision) { return os << precision.to_string(); }

PrecisionScope::PrecisionScope(const StepPrecision& precision)
    : cudnn_tf32_(at::globalContext().allowTF32CuDNN()), cublas_tf32_(at::globalContext().allowTF32CuBLAS()) {
  at::globalContext().setAllowTF32CuDNN(precision.tf32());
  at::globalContext().setAllowTF32CuBLAS(precision.tf32());
}

PrecisionScope::~PrecisionScope() {
  at::globalContext().setAllowTF32CuDNN(cudnn_tf32_);
  at::globalContext().setAllowTF32CuBLAS(cublas_tf32_);
}

}  // namespace hierpar::strategy
