// Which layer implementations a model is built from: stock torch::nn or hierpar's operators.
#pragma once

#include <ostream>
#include <string>

namespace hierpar {

enum class LayerSet { stock, hierpar };

// "stock" or "hierpar"; anything else throws c10::Error naming the accepted values.
LayerSet parse_layer_set(const std::string& name);
const char* to_string(LayerSet layers);
inline std::ostream& operator<<(std::ostream& os, LayerSet layers) { return os << to_string(layers); }

}  // namespace hierpar
