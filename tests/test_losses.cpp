// The adversarial losses (strategy/losses.h): BCE with logits against ATen's, and the hinge and Wasserstein terms.
#include "testing.h"

#include "hierpar/strategy/losses.h"

namespace hs = hierpar::strategy;

// The trainer's default loss gives binary_cross_entropy_with_logits' values and gradients against all-ones and
// all-zeros targets, for logits around 0 and far out in both tails (softplus switches to x beyond 20).
TEST(StrategyLoss, BceWithLogitsMatchesAten) {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    const double tol = dtype == torch::kFloat ? 1e-6 : 1e-12;
    auto logits = hierpar::testing::random_tensor({37, 1}, dtype).mul_(3);
    logits.index_put_({torch::indexing::Slice(0, 4)}, torch::tensor({-40.0, -19.5, 25.0, 90.0}, dtype).view({4, 1}));
    for (bool real : {true, false}) {
      auto ours_in = logits.clone().requires_grad_(), aten_in = logits.clone().requires_grad_();
      auto ours = hs::bce_with_logits_loss(ours_in, real ? hs::LossTerm::real : hs::LossTerm::fake);
      auto aten = torch::binary_cross_entropy_with_logits(aten_in, torch::full_like(logits, real ? 1.0 : 0.0));
      ours.backward();
      aten.backward();
      const std::string what = std::string(real ? "real" : "fake") + " target, " + c10::toString(dtype);
      EXPECT_TRUE(torch::allclose(ours, aten, tol, tol)) << what << ": " << ours.item<double>() << " vs " << aten.item<double>();
      EXPECT_TRUE(torch::allclose(ours_in.grad(), aten_in.grad(), tol, tol))
          << what << ": largest gradient difference " << (ours_in.grad() - aten_in.grad()).abs().max().item<double>();
    }
  }
  const auto logits = torch::tensor({-2.0, 0.5, 3.0});
  EXPECT_TRUE(torch::equal(hs::bce_with_logits_loss(logits, hs::LossTerm::generator),
                           hs::bce_with_logits_loss(logits, hs::LossTerm::real))) << "G's BCE targets real";
}

// The hinge and Wasserstein losses on known logits, each term; the loss names and their one-line error.
TEST(StrategyLoss, HingeAndWassersteinTerms) {
  const auto l = torch::tensor({-2.0, 0.5, 3.0}, torch::kDouble);
  auto value = [](const torch::Tensor& t) { return t.item<double>(); };
  EXPECT_DOUBLE_EQ(value(hs::hinge_loss(l, hs::LossTerm::real)), (3.0 + 0.5 + 0.0) / 3);   // relu(1 - l)
  EXPECT_DOUBLE_EQ(value(hs::hinge_loss(l, hs::LossTerm::fake)), (0.0 + 1.5 + 4.0) / 3);   // relu(1 + l)
  EXPECT_DOUBLE_EQ(value(hs::hinge_loss(l, hs::LossTerm::generator)), -(1.5 / 3));
  EXPECT_DOUBLE_EQ(value(hs::wasserstein_loss(l, hs::LossTerm::real)), -(1.5 / 3));
  EXPECT_DOUBLE_EQ(value(hs::wasserstein_loss(l, hs::LossTerm::fake)), 1.5 / 3);
  EXPECT_DOUBLE_EQ(value(hs::wasserstein_loss(l, hs::LossTerm::generator)), -(1.5 / 3));
  EXPECT_DOUBLE_EQ(value(hs::loss_by_name("hinge")(l, hs::LossTerm::fake)), value(hs::hinge_loss(l, hs::LossTerm::fake)));
  HIERPAR_EXPECT_THROW_MSG(hs::loss_by_name("lsgan"), "--loss: expected bce, hinge or wasserstein, got 'lsgan'");
}
