// The values of the flags every example program takes the same way: --device and --layers.
#pragma once

#include "hierpar/layer_set.h"

#include <torch/types.h>

#include <string>

namespace hierpar::examples {

torch::Device parse_device(const std::string& name);  // "", cpu, cuda, cuda:N; FlagError when not available
LayerSet parse_layers(const std::string& name);        // --layers: stock or hierpar; FlagError otherwise

}  // namespace hierpar::examples
