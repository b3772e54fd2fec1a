// hierpar::optim::Adam: a drop-in for torch::optim::Adam (same AdamOptions, same update, archives interchange) whose
// step is a few multi-tensor launches instead of about ten kernels per parameter, and stays on the device, so it can
// be captured into a CUDA graph (hierpar::strategy::GraphedStep). See hierpar/strategy/fused_adam.h for what it
// guarantees, and docs/user_loop.md for its use in a training loop.
//
//   hierpar::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
#pragma once

#include "hierpar/strategy/fused_adam.h"

namespace hierpar::optim {

using Adam = hierpar::strategy::FusedAdam;
using AdamOptions = torch::optim::AdamOptions;

}  // namespace hierpar::optim
