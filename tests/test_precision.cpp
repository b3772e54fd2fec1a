// StepPrecision (hierpar/strategy/precision.h): parsed from the flags once, printed as it is, applied as a scope.
#include "testing.h"

#include "hierpar/strategy/precision.h"

#include <ATen/Context.h>

#include <sstream>

namespace {

namespace hs = hierpar::strategy;
using Math = hs::StepPrecision::Math;

TEST(StepPrecision, FromFlagsOnEachDevice) {
  const auto tf32 = hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CUDA);
  EXPECT_EQ(tf32.math, Math::tf32);
  EXPECT_TRUE(tf32.tf32());
  EXPECT_FALSE(tf32.channels_last);
  EXPECT_FALSE(tf32.autocast_dtype().has_value());
  EXPECT_EQ(tf32.to_string(), "fp32 with TF32");
  EXPECT_STREQ(tf32.layout(), "nchw");

  const auto bf16 = hs::StepPrecision::from_flags("bf16", false, c10::DeviceType::CUDA);
  EXPECT_EQ(bf16.math, Math::bf16);
  EXPECT_TRUE(bf16.channels_last) << "bf16 implies channels_last";
  EXPECT_EQ(bf16.autocast_dtype(), c10::kBFloat16);
  std::ostringstream printed;
  printed << bf16;
  EXPECT_EQ(printed.str(), "bf16 autocast, channels_last");
  EXPECT_STREQ(bf16.name(), "bf16");

  const auto fp32 = hs::StepPrecision::from_flags("fp32", true, c10::DeviceType::CUDA);
  EXPECT_FALSE(fp32.tf32());
  EXPECT_EQ(fp32.to_string(), "fp32, channels_last");

  // TF32 is a CUDA mode: on the CPU "tf32" computes float32.
  const auto cpu = hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CPU);
  EXPECT_EQ(cpu.math, Math::fp32);
  EXPECT_STREQ(cpu.name(), "fp32");
}

TEST(StepPrecision, BadFlagsNameTheFlag) {
  HIERPAR_EXPECT_THROW_MSG(hs::StepPrecision::from_flags("fp16", false, c10::DeviceType::CUDA),
                           "--precision: expected fp32, tf32 or bf16, got 'fp16'");
  HIERPAR_EXPECT_THROW_MSG(hs::StepPrecision::from_flags("bf16", false, c10::DeviceType::CPU),
                           "--precision bf16 needs a CUDA device (this run is on the CPU)");
}

TEST(StepPrecision, ScopeSetsTf32AndRestores) {
  auto& context = at::globalContext();
  const bool cudnn = context.allowTF32CuDNN(), cublas = context.allowTF32CuBLAS();
  context.setAllowTF32CuDNN(false);
  context.setAllowTF32CuBLAS(true);
  {
    const hs::PrecisionScope scope(hs::StepPrecision::from_flags("tf32", false, c10::DeviceType::CUDA));
    EXPECT_TRUE(context.allowTF32CuDNN());
    EXPECT_TRUE(context.allowTF32CuBLAS());
    {
      const hs::PrecisionScope inner(hs::StepPrecision::from_flags("fp32", false, c10::DeviceType::CUDA));
      EXPECT_FALSE(context.allowTF32CuDNN());
      EXPECT_FALSE(context.allowTF32CuBLAS());
    }
    EXPECT_TRUE(context.allowTF32CuDNN());
  }
  EXPECT_FALSE(context.allowTF32CuDNN());
  EXPECT_TRUE(context.allowTF32CuBLAS());
  context.setAllowTF32CuDNN(cudnn);
  context.setAllowTF32CuBLAS(cublas);
}

}  // namespace
