// Meta kernel of hierpar::fused_adam_: the argument checks; an in-place update has no output to shape.
#include "fused_adam_shape.h"

#include <torch/library.h>

namespace hierpar::detail {
namespace {

struct NoUpdate {
  template <typename... Args>
  static void run(const Args&...) {}
};

}  // namespace
}  // namespace hierpar::detail

TORCH_LIBRARY_IMPL(hierpar, Meta, m) {
  hierpar::detail::register_fused_adam<hierpar::detail::NoUpdate>(m);
}
