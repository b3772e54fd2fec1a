#include "hierpar/nn/max_pool.h"

#include "hierpar/ops.h"

#include <ostream>

namespace hierpar::nn {

MaxPool2dImpl::MaxPool2dImpl(const torch::nn::MaxPool2dOptions& options_) : options(options_) { reset(); }

void MaxPool2dImpl::reset() {}  // no parameters or buffers

void MaxPool2dImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "hierpar::nn::MaxPool2d(kernel_size=" << options.kernel_size()
         << ", stride=" << options.stride() << ", padding=" << options.padding()
         << ", dilation=" << options.dilation() << ", ceil_mode=" << options.ceil_mode() << ")";
}

torch::Tensor MaxPool2dImpl::forward(const torch::Tensor& input) {
  return std::get<0>(ops::max_pool2d(input, *options.kernel_size(), *options.stride(), *options.padding(),
                                     *options.dilation(), options.ceil_mode()));
}

torch::Tensor MaxPool2dImpl::forward_relu(const torch::Tensor& input) {
  return std::get<0>(ops::max_pool2d(input, *options.kernel_size(), *options.stride(), *options.padding(),
                                     *options.dilation(), options.ceil_mode(), /*relu=*/true));
}

}  // namespace hierpar::nn
