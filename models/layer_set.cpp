#include "hierpar/layer_set.h"

#include <c10/util/Exception.h>

namespace hierpar {

LayerSet parse_layer_set(const std::string& name) {
  if (name == "stock") return LayerSet::stock;
  if (name == "hierpar") return LayerSet::hierpar;
  TORCH_CHECK(false, "layers: expected 'stock' or 'hierpar', got '", name, "'");
}

const char* to_string(LayerSet layers) { return layers == LayerSet::stock ? "stock" : "hierpar"; }

}  // namespace hierpar
