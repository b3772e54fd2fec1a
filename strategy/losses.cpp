#include "hierpar/strategy/losses.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace hierpar::strategy {

torch::Tensor bce_with_logits_loss(const torch::Tensor& logits, LossTerm term) {
  // Against a constant target the loss is -log(sigmoid(x)) = softplus(-x) (real) or -log(1 - sigmoid(x)) =
  // softplus(x) (fake): binary_cross_entropy_with_logits with a target tensor took 8 kernels forward and 6 backward
  // (the target's fill among them), a captured batch-64 step 3 such losses, 2 of them on its critical path.
  return torch::softplus(term == LossTerm::fake ? logits : -logits).mean();
}

torch::Tensor hinge_loss(const torch::Tensor& logits, LossTerm term) {
  switch (term) {
    case LossTerm::real: return torch::relu(1 - logits).mean();
    case LossTerm::fake: return torch::relu(1 + logits).mean();
    case LossTerm::generator: break;
  }
  return -logits.mean();
}

torch::Tensor wasserstein_loss(const torch::Tensor& logits, LossTerm term) {
  return term == LossTerm::fake ? logits.mean() : -logits.mean();
}

AdversarialLoss loss_by_name(const std::string& name, const std::string& flag) {
  if (name == "bce") return bce_with_logits_loss;
  if (name == "hinge") return hinge_loss;
  if (name == "wasserstein") return wasserstein_loss;
  TORCH_CHECK(false, "--", flag, ": expected bce, hinge or wasserstein, got '", name, "'");
}

}  // namespace hierpar::strategy
