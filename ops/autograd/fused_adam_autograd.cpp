// hierpar::fused_adam_ is an optimiser update: it is not differentiated, and the parameters it writes in place
// are leaves that require grad. Autograd passes it through to the backend kernel (as torch.optim's updates run
// under no_grad), instead of the default fallback's error on in-place updates of such leaves.
#include <torch/library.h>

TORCH_LIBRARY_IMPL(hierpar, Autograd, m) {
  m.impl("fused_adam_", torch::CppFunction::makeFallthrough());
  m.impl("fused_adam_.tensor_lr", torch::CppFunction::makeFallthrough());
}
