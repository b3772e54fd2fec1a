// hierpar::nn::convert: replaces the stock torch::nn::Conv2d, ConvTranspose2d, BatchNorm2d and MaxPool2d layers of a
// module tree by hierpar::nn's, in place, as torch.nn.SyncBatchNorm.convert_sync_batchnorm does for batch norm (and
// as Python's hierpar.nn.convert does), and fuses a Sequential's BatchNorm2d + ReLU/LeakyReLU pairs into
// BatchNormAct2d. The per-layer hierpar::nn::converted functions do the same for one layer.
//
//   torch::nn::Sequential generator(torch::nn::ConvTranspose2d(...), torch::nn::BatchNorm2d(256),
//                                   torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)), ...);
//   torch::optim::Adam adam(generator->parameters(), ...);   // may be built before: it keeps working
//   std::cout << hierpar::nn::convert(generator);            // a table: converted, fused, left (and why)
//   generator->forward(z);                                   // the same holder, now on hierpar's layers
//
// What a conversion keeps: every converted layer holds the SAME parameter and buffer tensors as the stock one it
// replaces (the same TensorImpl, requires_grad as it was), its options and its train/eval flag. named_parameters(),
// named_buffers(), parameters() and state dicts list the same keys and tensors before and after, so an optimizer
// built before the conversion updates the converted model, and torch::save / torch::load interchange checkpoints with
// the stock model in both directions. A fused activation's slot becomes torch::nn::Identity: names and indices stay.
// A stock layer shared by several slots becomes one hierpar layer in all of them. Forward and backward compute what
// the stock layers compute (to rounding: other kernels), with one difference after a fused LeakyReLU that convert
// avoids (below).
//
// Where it converts: only inside a torch::nn::Sequential, which calls its layers through its own list, so that
// replacing a slot (both that list and the registry that children() reads) changes what the user's Sequential holder
// runs. Everything else is left as it was and reported in `left`, with the reason and the fix:
// - a layer that is a member of a user's module (`torch::nn::Conv2d conv1{nullptr}` + register_module): its forward
//   calls the member holder, which convert cannot rebind, so a replaced registry entry would never run. Fix: declare
//   the member as hierpar::nn::Conv2d (its constructor takes the same options), or, for a trained stock layer,
//   assign it `replace_module("conv1", hierpar::nn::converted(old))`;
// - an entry of a torch::nn::ModuleList or ModuleDict: callers usually cast entries to the stock type
//   (`list[i]->as<torch::nn::Conv2d>()`), which a replacement would turn into a null pointer;
// - the root itself, which the caller holds: use hierpar::nn::converted;
// - a subclass of a stock layer (its forward or state may differ), parameters in a dtype or on a device hierpar's
//   ops do not take (they take float32, float64, bfloat16 and float16 on the CPU, CUDA and Meta), a MaxPool2d whose
//   window has more than 256 elements (hierpar's uint8 window index) or padding above half its kernel, a
//   ConvTranspose2d with a padding_mode other than zeros, and layers that are already hierpar's.
// Modules of other kinds are neither touched nor reported; convert descends into every child module.
//
// Fusion (ConvertOptions::fuse_activations): inside a torch::nn::Sequential, a BatchNorm2d immediately followed by a
// torch::nn::ReLU or LeakyReLU (inplace or not) becomes one hierpar::nn::BatchNormAct2d with that activation (listed
// in `converted` and, with the activation's name, in `fused`). Not fused, reported in `left` under the activation's
// name (the batch norm is still converted, alone):
// - a pair in a subclass of torch::nn::Sequential, whose own forward may not run its layers in order;
// - a LeakyReLU with negative_slope <= 0, and one after a batch norm whose weight has a zero: BatchNormAct2d's
//   backward recovers the pre-activation by inverting the LeakyReLU from its output;
// - a LeakyReLU(inplace false) whose output leaves the Sequential or goes to a module that may modify it in place:
//   BatchNormAct2d(leaky_relu) keeps its output for backward where the stock LeakyReLU keeps its input, so an
//   in-place op on that output would make autograd refuse the backward that stock's runs.
// A batch norm and an activation in different containers are converted, not fused.
#pragma once

#include "hierpar/nn/batch_norm.h"
#include "hierpar/nn/conv2d.h"
#include "hierpar/nn/conv_transpose.h"
#include "hierpar/nn/max_pool.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace hierpar::nn {

struct ConvertOptions {
  // Fuse a Sequential's BatchNorm2d + ReLU/LeakyReLU pairs into BatchNormAct2d (see above).
  bool fuse_activations = true;
};

// What convert did. Names are qualified as named_modules() spells them ("" is the root); types as users write them
// ("torch::nn::Conv2d", "hierpar::nn::BatchNormAct2d"). Printed (operator<<): a table of the three lists.
struct ConversionReport {
  struct Entry {
    std::string name;        // the layer's name; fused: the batch norm's
    std::string from;        // its type before (left: its type)
    std::string to;          // converted and fused: its type now; left: ""
    std::string activation;  // fused: the activation's name (now a torch::nn::Identity); otherwise ""
    std::string reason;      // left: why, and what to do instead; otherwise ""
  };
  std::vector<Entry> converted;  // every layer replaced (a fused batch norm too)
  std::vector<Entry> fused;      // every batch norm + activation pair that became one BatchNormAct2d
  std::vector<Entry> left;       // every layer of those kinds left as it was, and every activation not fused
};
std::ostream& operator<<(std::ostream& stream, const ConversionReport& report);

// Converts `module`'s tree in place (see above) and says what it did. Throws (c10::Error) only for a null module.
ConversionReport convert(const std::shared_ptr<torch::nn::Module>& module, ConvertOptions options = {});
template <typename ModuleType>
ConversionReport convert(const torch::nn::ModuleHolder<ModuleType>& module, ConvertOptions options = {}) {
  return convert(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

// One layer: hierpar::nn's layer with the stock layer's options, train/eval flag and its very parameter and buffer
// tensors (as convert does), for a layer convert leaves, e.g. a member of a user's module:
//   struct Net : torch::nn::Module { hierpar::nn::Conv2d conv1{nullptr}; ... };   // was torch::nn::Conv2d
//   net->conv1 = net->replace_module("conv1", hierpar::nn::converted(trained_stock_conv));
// Throws (c10::Error, with the reason convert would report) for a layer convert would leave for its own properties
// (dtype, device, a subclass, a MaxPool2d window over 256 elements, ...).
Conv2d converted(const torch::nn::Conv2d& stock);
ConvTranspose2d converted(const torch::nn::ConvTranspose2d& stock);
BatchNorm2d converted(const torch::nn::BatchNorm2d& stock);
// A batch norm with `activation` fused in, as for a BatchNorm2d followed by torch::nn::ReLU (relu) or
// LeakyReLU(negative_slope) (leaky_relu, negative_slope > 0).
BatchNormAct2d converted(const torch::nn::BatchNorm2d& stock, Activation activation, double negative_slope = 0.01);
MaxPool2d converted(const torch::nn::MaxPool2d& stock);

}  // namespace hierpar::nn
