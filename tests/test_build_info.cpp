// hierpar::cuda_arch_list / cuda_code_arch (ops/build_info.cpp): what the build holds, and which of it each GPU runs.
#include "testing.h"

#include <hierpar/ops.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/env.h>
#ifdef HIERPAR_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <regex>
#include <sstream>

namespace {

std::vector<std::string> words(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> out;
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

// "8.0+PTX" -> 80
int arch_number(const std::string& word) {
  const auto dot = word.find('.');
  return std::stoi(word.substr(0, dot)) * 10 + (word[dot + 1] - '0');
}

TEST(BuildInfo, ArchListIsWhatCMakeBuilt) {
#ifdef HIERPAR_WITH_CUDA
  const std::string list = hierpar::ops::cuda_arch_list();
  EXPECT_EQ(list, HIERPAR_TEST_CUDA_ARCH_LIST);  // the configure's resolved TORCH_CUDA_ARCH_LIST
  ASSERT_FALSE(words(list).empty());
  for (const auto& w : words(list)) EXPECT_TRUE(std::regex_match(w, std::regex(R"(\d+\.\d[af]?(\+PTX)?)"))) << w;
#else
  EXPECT_EQ(hierpar::ops::cuda_arch_list(), "");
#endif
}

TEST(BuildInfo, RegisteredAsOps) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hierpar::cuda_arch_list", "").typed<std::string()>();
  EXPECT_EQ(op.call(), hierpar::ops::cuda_arch_list());
  EXPECT_TRUE(c10::Dispatcher::singleton().findSchema({"hierpar::cuda_code_arch", ""}).has_value());
}

TEST(BuildInfo, CodeArchOfAMissingDevice) {
#ifdef HIERPAR_WITH_CUDA
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::cuda_code_arch(999), "CUDA device 999 does not exist");
#else
  HIERPAR_EXPECT_THROW_MSG(hierpar::ops::cuda_code_arch(0), "no CUDA kernels");
#endif
}

// Each GPU runs code of an architecture the build holds, no newer than the GPU. Under `scripts/gpu-check --arch X.Y`
// (HIERPAR_EXPECT_CODE_ARCH=XY) it is that architecture's: on a newer GPU its PTX, compiled by the driver, so the
// suite's other tests run every kernel's pre-Hopper path.
#ifdef HIERPAR_WITH_CUDA
TEST(BuildInfo, GpuRunsCodeOfTheBuild) {
  HIERPAR_REQUIRE_CUDA();
  std::vector<int> built;
  for (const auto& w : words(hierpar::ops::cuda_arch_list())) built.push_back(arch_number(w));
  const auto expected = c10::utils::get_env("HIERPAR_EXPECT_CODE_ARCH");
  for (int d = 0; d < static_cast<int>(torch::cuda::device_count()); ++d) {
    const std::string code = hierpar::ops::cuda_code_arch(d);
    std::smatch m;
    ASSERT_TRUE(std::regex_match(code, m, std::regex(R"((sm|compute)_(\d+)( \(PTX compiled by the driver for sm_(\d+)\))?)")))
        << code;
    const int arch = std::stoi(m[2]);
    EXPECT_NE(std::find(built.begin(), built.end(), arch), built.end()) << code << " not in " << hierpar::ops::cuda_arch_list();
    const auto props = at::cuda::getDeviceProperties(d);
    EXPECT_LE(arch, props->major * 10 + props->minor) << code;
    if (expected) {
      EXPECT_EQ(arch, std::stoi(*expected)) << "GPU " << d << " runs " << code;
      if (std::stoi(*expected) < props->major * 10) EXPECT_EQ(m[1], "compute") << code;
    }
    std::cout << "GPU " << d << " (" << props->name << "): " << code << "\n";
  }
}
#endif

}  // namespace
