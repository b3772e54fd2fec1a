// Every hierpar operator is registered with the dispatcher under the hierpar namespace, with kernels
// for each backend it promises.
#include "testing.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

const char* const kOps[] = {"max_pool2d",     "max_pool2d_backward",       "batch_norm_act",
                            "batch_norm_act_backward", "conv_transpose2d", "conv_transpose2d_backward",
                            "conv2d",         "conv2d_backward",           "fused_adam_"};

TEST(Registry, EveryOpHasASchema) {
  for (const char* name : kOps) {
    auto handle = c10::Dispatcher::singleton().findSchema({std::string("hierpar::") + name, ""});
    EXPECT_TRUE(handle.has_value()) << "hierpar::" << name << " is not registered";
  }
}

TEST(Registry, EveryOpHasCpuMetaAndAutogradKernels) {
  for (const char* name : kOps) {
    auto handle = c10::Dispatcher::singleton().findSchema({std::string("hierpar::") + name, ""});
    ASSERT_TRUE(handle.has_value()) << name;
    for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::Meta, c10::DispatchKey::Autograd}) {
      EXPECT_TRUE(handle->hasKernelForDispatchKey(key))
          << "hierpar::" << name << " has no " << c10::toString(key) << " kernel";
    }
  }
}

TEST(Registry, EveryOpHasACudaKernelInACudaBuild) {
#ifndef HIERPAR_WITH_CUDA
  GTEST_SKIP() << "this build has no CUDA kernels (LibTorch without CUDA)";
#endif
  for (const char* name : kOps) {
    auto handle = c10::Dispatcher::singleton().findSchema({std::string("hierpar::") + name, ""});
    ASSERT_TRUE(handle.has_value()) << name;
    EXPECT_TRUE(handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) << "hierpar::" << name << " has no CUDA kernel";
  }
}

}  // namespace
