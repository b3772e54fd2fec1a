// hierpar::nn::convert on the seed's DCGAN written as a LibTorch user writes it (stock layers in Sequentials), on a
// user module with member layers, and on the container and fusion edge cases; hierpar::nn::converted on one layer.
// Float64 on the CPU: the converted model matches an unconverted copy to 1e-10, shares every tensor, keeps training
// under an optimizer built before the conversion, and interchanges checkpoints with the stock model.
#include "testing.h"

#include "hierpar/nn.h"

#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using hierpar::testing::random_tensor;
namespace tnn = torch::nn;

constexpr double kTol = 1e-10;

tnn::ReLU relu_inplace() { return tnn::ReLU(tnn::ReLUOptions().inplace(true)); }
tnn::LeakyReLU leaky_inplace(double slope = 0.2) {
  return tnn::LeakyReLU(tnn::LeakyReLUOptions().negative_slope(slope).inplace(true));
}

// The seed's generator, 64x64 output, at widths w * {8, 4, 2, 1} (the seed's: nz 100, w 32). As in the seed, no
// convolution before a batch norm has a bias (its gradient would be rounding noise, which Adam scales to full steps);
// the last one has.
tnn::Sequential generator(int64_t nz, int64_t w) {
  auto up = [](int64_t in, int64_t out, int64_t stride, int64_t padding, bool bias) {
    return tnn::ConvTranspose2d(tnn::ConvTranspose2dOptions(in, out, 4).stride(stride).padding(padding).bias(bias));
  };
  return tnn::Sequential(up(nz, 8 * w, 1, 0, false), tnn::BatchNorm2d(8 * w), relu_inplace(),     // 0, 1, 2
                         up(8 * w, 4 * w, 2, 1, false), tnn::BatchNorm2d(4 * w), relu_inplace(),  // 3, 4, 5
                         up(4 * w, 2 * w, 2, 1, false), tnn::BatchNorm2d(2 * w), relu_inplace(),  // 6, 7, 8
                         up(2 * w, w, 2, 1, false), tnn::BatchNorm2d(w), relu_inplace(),          // 9, 10, 11
                         up(w, 3, 2, 1, true), tnn::Tanh());                                       // 12, 13
}

// The seed's discriminator on 64x64 images, at widths w * {1, 2, 4, 8}; biases as in the generator.
tnn::Sequential discriminator(int64_t w) {
  auto down = [](int64_t in, int64_t out, int64_t stride, int64_t padding, bool bias) {
    return tnn::Conv2d(tnn::Conv2dOptions(in, out, 4).stride(stride).padding(padding).bias(bias));
  };
  return tnn::Sequential(down(3, w, 2, 1, false), leaky_inplace(),                                 // 0, 1
                         down(w, 2 * w, 2, 1, false), tnn::BatchNorm2d(2 * w), leaky_inplace(),    // 2, 3, 4
                         down(2 * w, 4 * w, 2, 1, false), tnn::BatchNorm2d(4 * w), leaky_inplace(),  // 5, 6, 7
                         down(4 * w, 8 * w, 2, 1, false), tnn::BatchNorm2d(8 * w), leaky_inplace(),  // 8, 9, 10
                         down(8 * w, 1, 1, 0, true), tnn::Sigmoid());                              // 11, 12
}

// Float64, and batch norms with non-trivial state (weight away from zero, bias and running statistics random), so
// that nothing is compared on the initial zeros and ones.
void prepare(tnn::Module& model) {
  model.to(torch::kDouble);
  torch::NoGradGuard no_grad;
  for (auto& m : model.modules()) {
    if (auto* bn = dynamic_cast<tnn::BatchNorm2dImpl*>(m.get())) {
      const int64_t c = bn->options.num_features();
      bn->weight.copy_(random_tensor({c}, torch::kDouble).mul_(0.5).add_(1));
      bn->bias.copy_(random_tensor({c}, torch::kDouble));
      bn->running_mean.copy_(random_tensor({c}, torch::kDouble));
      bn->running_var.copy_(random_tensor({c}, torch::kDouble).mul_(0.4).add_(1));
      bn->num_batches_tracked.fill_(3);
    }
  }
}

struct Gan {
  tnn::Sequential g, d;
  int64_t nz;
};

// A small DCGAN (nz 8, width 4) in float64 with non-trivial state; `copy`, when given, receives a deep copy.
Gan small_gan(Gan* copy = nullptr) {
  hierpar::testing::rng();  // seeds torch for this test before the layers draw their initial values
  Gan gan{generator(8, 4), discriminator(4), 8};
  prepare(*gan.g);
  prepare(*gan.d);
  if (copy != nullptr) {
    *copy = Gan{tnn::Sequential(std::dynamic_pointer_cast<tnn::SequentialImpl>(gan.g->clone())),
                tnn::Sequential(std::dynamic_pointer_cast<tnn::SequentialImpl>(gan.d->clone())), gan.nz};
  }
  return gan;
}

std::vector<std::string> names(const std::vector<hierpar::nn::ConversionReport::Entry>& entries) {
  std::vector<std::string> result;
  for (const auto& e : entries) result.push_back(e.name);
  return result;
}

template <typename Impl>
bool slot_is(const tnn::Sequential& seq, size_t i) {
  return std::dynamic_pointer_cast<Impl>(seq->ptr(i)) != nullptr;
}

// Every parameter and buffer by name, with the TensorImpl and data pointer it has now.
std::map<std::string, std::pair<const void*, const void*>> tensor_identities(const tnn::Module& m) {
  std::map<std::string, std::pair<const void*, const void*>> result;
  for (const auto& p : m.named_parameters()) result["p:" + p.key()] = {p->unsafeGetTensorImpl(), p->data_ptr()};
  for (const auto& b : m.named_buffers()) result["b:" + b.key()] = {b->unsafeGetTensorImpl(), b->data_ptr()};
  return result;
}

void expect_same_values(const tnn::Module& actual, const tnn::Module& expected, double tol, const std::string& what) {
  const auto pa = actual.named_parameters(), pe = expected.named_parameters();
  const auto ba = actual.named_buffers(), be = expected.named_buffers();
  ASSERT_EQ(pa.keys(), pe.keys()) << what;
  ASSERT_EQ(ba.keys(), be.keys()) << what;
  for (const auto& k : pa.keys()) hierpar::testing::expect_close(pa[k], pe[k], {tol, tol}, what + " parameter " + k);
  for (const auto& k : ba.keys()) hierpar::testing::expect_close(ba[k], be[k], {tol, tol}, what + " buffer " + k);
}

void expect_same_grads(const tnn::Module& actual, const tnn::Module& expected, const std::string& what) {
  const auto pa = actual.named_parameters(), pe = expected.named_parameters();
  ASSERT_EQ(pa.keys(), pe.keys()) << what;
  for (const auto& k : pa.keys()) {
    ASSERT_TRUE(pa[k].grad().defined() && pe[k].grad().defined()) << what << " " << k << ": no gradient";
    hierpar::testing::expect_close(pa[k].grad(), pe[k].grad(), {kTol, kTol}, what + " grad of " + k);
  }
}

// ---- the DCGAN ----------------------------------------------------------------------------------------------

TEST(ConvertDcgan, ReportListsEveryLayerAndFusesTheBatchNormActivationPairs) {
  Gan gan = small_gan();
  const auto g = hierpar::nn::convert(gan.g);
  EXPECT_EQ(names(g.converted), (std::vector<std::string>{"0", "1", "3", "4", "6", "7", "9", "10", "12"})) << g;
  EXPECT_EQ(names(g.fused), (std::vector<std::string>{"1", "4", "7", "10"})) << g;
  EXPECT_TRUE(g.left.empty()) << g;
  for (const auto& e : g.fused) {
    EXPECT_EQ(e.activation, std::to_string(std::stoi(e.name) + 1));
    EXPECT_EQ(e.from, "torch::nn::BatchNorm2d + torch::nn::ReLU");
    EXPECT_EQ(e.to, "hierpar::nn::BatchNormAct2d");
  }
  EXPECT_EQ(g.converted[0].from, "torch::nn::ConvTranspose2d");
  EXPECT_EQ(g.converted[0].to, "hierpar::nn::ConvTranspose2d");
  for (size_t i : {0, 3, 6, 9, 12}) EXPECT_TRUE(slot_is<hierpar::nn::ConvTranspose2dImpl>(gan.g, i)) << i;
  for (size_t i : {1, 4, 7, 10}) {
    auto bn = std::dynamic_pointer_cast<hierpar::nn::BatchNormAct2dImpl>(gan.g->ptr(i));
    ASSERT_TRUE(bn) << i;
    EXPECT_EQ(bn->activation, hierpar::nn::Activation::relu);
    EXPECT_TRUE(slot_is<tnn::IdentityImpl>(gan.g, i + 1)) << i + 1;
  }
  EXPECT_TRUE(slot_is<tnn::TanhImpl>(gan.g, 13));

  const auto d = hierpar::nn::convert(gan.d);
  EXPECT_EQ(names(d.converted), (std::vector<std::string>{"0", "2", "3", "5", "6", "8", "9", "11"})) << d;
  EXPECT_EQ(names(d.fused), (std::vector<std::string>{"3", "6", "9"})) << d;
  EXPECT_TRUE(d.left.empty()) << d;  // the LeakyReLU after the first convolution follows no batch norm
  EXPECT_TRUE(slot_is<tnn::LeakyReLUImpl>(gan.d, 1));
  for (size_t i : {3, 6, 9}) {
    auto bn = std::dynamic_pointer_cast<hierpar::nn::BatchNormAct2dImpl>(gan.d->ptr(i));
    ASSERT_TRUE(bn) << i;
    EXPECT_EQ(bn->activation, hierpar::nn::Activation::leaky_relu);
    EXPECT_EQ(bn->negative_slope, 0.2);
  }
  // The Sequential's registry (children(), state dicts) and the list its forward runs agree.
  for (const auto& seq : {gan.g, gan.d}) {
    const auto children = seq->children();
    ASSERT_EQ(children.size(), seq->size());
    for (size_t i = 0; i < seq->size(); ++i) EXPECT_EQ(children[i], seq->ptr(i)) << i;
  }
}

TEST(ConvertDcgan, KeepsEveryParameterAndBufferTensorAndTheTrainEvalFlag) {
  Gan gan = small_gan();
  gan.d->eval();
  const auto g_before = tensor_identities(*gan.g), d_before = tensor_identities(*gan.d);
  hierpar::nn::convert(gan.g);
  hierpar::nn::convert(gan.d);
  EXPECT_EQ(tensor_identities(*gan.g), g_before);
  EXPECT_EQ(tensor_identities(*gan.d), d_before);
  for (const auto& m : gan.g->modules(/*include_self=*/false)) EXPECT_TRUE(m->is_training()) << m->name();
  for (const auto& m : gan.d->modules(/*include_self=*/false)) EXPECT_FALSE(m->is_training()) << m->name();
}

// One G + D forward and backward of `gan` and of `copy` (unconverted) on the same data: outputs, the latent's
// gradient, every parameter's gradient and (training) the updated running statistics.
void expect_same_pass(Gan& gan, Gan& copy, bool training, const std::string& what) {
  for (auto* m : {&gan.g, &gan.d, &copy.g, &copy.d}) (*m)->train(training);
  const auto z = random_tensor({2, gan.nz, 1, 1}, torch::kDouble);
  const auto r = random_tensor({2, 1, 1, 1}, torch::kDouble);
  auto za = z.clone().requires_grad_(), ze = z.clone().requires_grad_();
  const auto xa = gan.g->forward(za), xe = copy.g->forward(ze);
  hierpar::testing::expect_close(xa, xe, {kTol, kTol}, what + " generator output");
  const auto ya = gan.d->forward(xa), ye = copy.d->forward(xe);
  hierpar::testing::expect_close(ya, ye, {kTol, kTol}, what + " discriminator output");
  (ya * r).sum().backward();
  (ye * r).sum().backward();
  hierpar::testing::expect_close(za.grad(), ze.grad(), {kTol, kTol}, what + " latent gradient");
  expect_same_grads(*gan.g, *copy.g, what + " generator");
  expect_same_grads(*gan.d, *copy.d, what + " discriminator");
  expect_same_values(*gan.g, *copy.g, kTol, what + " generator state");
  expect_same_values(*gan.d, *copy.d, kTol, what + " discriminator state");
}

TEST(ConvertDcgan, MatchesAnUnconvertedCopyForwardAndBackwardInTrainingAndEval) {
  Gan copy;
  Gan gan = small_gan(&copy);
  hierpar::nn::convert(gan.g);
  hierpar::nn::convert(gan.d);
  expect_same_pass(gan, copy, /*training=*/true, "training");
  for (auto* m : {&gan.g, &gan.d, &copy.g, &copy.d}) (*m)->zero_grad();
  expect_same_pass(gan, copy, /*training=*/false, "eval");
}

TEST(ConvertDcgan, AnAdamBuiltBeforeTheConversionTrainsTheConvertedModel) {
  Gan copy;
  Gan gan = small_gan(&copy);
  auto params = [](const Gan& m) {
    auto p = m.g->parameters();
    for (const auto& q : m.d->parameters()) p.push_back(q);
    return p;
  };
  torch::optim::Adam adam(params(gan), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam adam_copy(params(copy), torch::optim::AdamOptions(1e-2));
  hierpar::nn::convert(gan.g);
  hierpar::nn::convert(gan.d);
  const auto first = gan.g->parameters()[0].detach().clone();
  for (int step = 0; step < 2; ++step) {
    adam.zero_grad();
    adam_copy.zero_grad();
    const auto z = random_tensor({2, gan.nz, 1, 1}, torch::kDouble);
    gan.d->forward(gan.g->forward(z)).mean().backward();
    copy.d->forward(copy.g->forward(z)).mean().backward();
    adam.step();
    adam_copy.step();
    expect_same_values(*gan.g, *copy.g, kTol, "generator after step " + std::to_string(step));
    expect_same_values(*gan.d, *copy.d, kTol, "discriminator after step " + std::to_string(step));
  }
  // The steps moved the parameters: the converted layers read the tensors the optimizer updates.
  EXPECT_FALSE(gan.g->parameters()[0].equal(first));
}

TEST(ConvertDcgan, CheckpointsInterchangeWithTheStockModel) {
  Gan gan = small_gan();
  hierpar::nn::convert(gan.g);
  gan.g->forward(random_tensor({2, gan.nz, 1, 1}, torch::kDouble));  // running statistics move
  std::stringstream converted_file;
  torch::save(gan.g, converted_file);
  auto stock = generator(8, 4);
  stock->to(torch::kDouble);
  torch::load(stock, converted_file);
  expect_same_values(*stock, *gan.g, 0, "hierpar -> stock");

  auto other = generator(8, 4);
  prepare(*other);  // new random state
  std::stringstream stock_file;
  torch::save(other, stock_file);
  const auto identities = tensor_identities(*gan.g);
  torch::load(gan.g, stock_file);
  expect_same_values(*gan.g, *other, 0, "stock -> hierpar");
  // Loading writes into the registered tensors: the converted layers still read them.
  auto impls = [](const std::map<std::string, std::pair<const void*, const void*>>& m) {
    std::map<std::string, const void*> r;
    for (const auto& [k, v] : m) r[k] = v.first;
    return r;
  };
  EXPECT_EQ(impls(tensor_identities(*gan.g)), impls(identities));
  const auto z = random_tensor({2, gan.nz, 1, 1}, torch::kDouble);
  gan.g->eval();
  other->eval();
  hierpar::testing::expect_close(gan.g->forward(z), other->forward(z), {kTol, kTol}, "forward after loading");
}

TEST(ConvertDcgan, CloneOfAConvertedModelHasTensorsOfItsOwn) {
  Gan gan = small_gan();
  hierpar::nn::convert(gan.g);
  auto copy = tnn::Sequential(std::dynamic_pointer_cast<tnn::SequentialImpl>(gan.g->clone()));
  ASSERT_TRUE(slot_is<hierpar::nn::ConvTranspose2dImpl>(copy, 0));
  ASSERT_TRUE(slot_is<hierpar::nn::BatchNormAct2dImpl>(copy, 1));
  expect_same_values(*copy, *gan.g, 0, "clone");
  const auto a = copy->named_parameters(), b = gan.g->named_parameters();
  for (const auto& k : a.keys()) EXPECT_NE(a[k].data_ptr(), b[k].data_ptr()) << k;
}

// ---- where convert does not convert -----------------------------------------------------------------------------

struct MemberNet : tnn::Module {
  MemberNet() {
    conv1 = register_module("conv1", tnn::Conv2d(tnn::Conv2dOptions(3, 4, 3).padding(1)));
    bn1 = register_module("bn1", tnn::BatchNorm2d(4));
    features = register_module("features", tnn::Sequential(tnn::Conv2d(tnn::Conv2dOptions(4, 5, 3)),
                                                           tnn::BatchNorm2d(5), relu_inplace()));
  }
  torch::Tensor forward(const torch::Tensor& x) { return features->forward(torch::relu(bn1(conv1(x)))); }
  tnn::Conv2d conv1{nullptr};
  tnn::BatchNorm2d bn1{nullptr};
  tnn::Sequential features{nullptr};
};

TEST(ConvertMembers, MemberLayersAreLeftAndReportedWithTheReasonAndTheFix) {
  hierpar::testing::rng();
  auto net = std::make_shared<MemberNet>();
  const auto conv1 = net->conv1.ptr();
  const auto report = hierpar::nn::convert(net);
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"conv1", "bn1"})) << report;
  EXPECT_EQ(report.left[0].from, "torch::nn::Conv2d");
  EXPECT_NE(report.left[0].reason.find("a member of"), std::string::npos) << report.left[0].reason;
  EXPECT_NE(report.left[0].reason.find("declare it as hierpar::nn::Conv2d"), std::string::npos)
      << report.left[0].reason;
  EXPECT_NE(report.left[1].reason.find("declare it as hierpar::nn::BatchNorm2d"), std::string::npos);
  EXPECT_EQ(names(report.converted), (std::vector<std::string>{"features.0", "features.1"})) << report;
  EXPECT_EQ(names(report.fused), (std::vector<std::string>{"features.1"})) << report;
  // The members and the registry still hold the stock layers; the member's Sequential holder sees the conversion.
  EXPECT_EQ(net->conv1.ptr(), conv1);
  EXPECT_EQ(net->named_children()["conv1"], conv1);
  EXPECT_TRUE(std::dynamic_pointer_cast<hierpar::nn::BatchNormAct2dImpl>(net->features->ptr(1)));
  net->to(torch::kDouble);
  EXPECT_EQ(net->forward(random_tensor({2, 3, 6, 5}, torch::kDouble)).sizes(), (std::vector<int64_t>{2, 5, 4, 3}));
  std::ostringstream printed;
  printed << report;
  EXPECT_NE(printed.str().find("left:\n  conv1  torch::nn::Conv2d"), std::string::npos) << printed.str();
}

// What a user with member layers writes instead: converted() per layer, the same tensors, flag and options.
TEST(ConvertMembers, ConvertedSharesTheLayersTensorsFlagAndOptions) {
  hierpar::testing::rng();
  tnn::Conv2d conv(tnn::Conv2dOptions(3, 4, 3).stride(2).padding(1).padding_mode(torch::kReflect));
  conv->to(torch::kDouble);
  conv->eval();
  auto ours = hierpar::nn::converted(conv);
  EXPECT_TRUE(ours->weight.is_same(conv->weight));
  EXPECT_TRUE(ours->bias.is_same(conv->bias));
  EXPECT_FALSE(ours->is_training());
  const auto x = random_tensor({2, 3, 7, 6}, torch::kDouble);
  hierpar::testing::expect_close(ours(x), conv(x), {kTol, kTol}, "converted Conv2d");

  tnn::BatchNorm2d bn(tnn::BatchNorm2dOptions(4).affine(false).momentum(std::nullopt));
  const auto act = hierpar::nn::converted(bn, hierpar::nn::Activation::leaky_relu, 0.1);
  EXPECT_TRUE(act->running_mean.is_same(bn->running_mean));
  EXPECT_TRUE(act->num_batches_tracked.is_same(bn->num_batches_tracked));
  EXPECT_FALSE(act->weight.defined());
  EXPECT_FALSE(act->options.momentum().has_value());

  tnn::ConvTranspose2d deconv(tnn::ConvTranspose2dOptions(4, 3, 4).stride(2).padding(1).bias(false));
  EXPECT_TRUE(hierpar::nn::converted(deconv)->weight.is_same(deconv->weight));
  HIERPAR_EXPECT_THROW_MSG(hierpar::nn::converted(tnn::MaxPool2d(tnn::MaxPool2dOptions(17))),
                           "289 elements per window: hierpar's uint8 window index addresses at most 256");
}

TEST(ConvertContainers, ListAndDictEntriesRootLayersAndHierparLayersAreLeft) {
  hierpar::testing::rng();
  tnn::ModuleList list(tnn::Conv2d(tnn::Conv2dOptions(3, 4, 3)), tnn::ReLU());
  auto report = hierpar::nn::convert(list);
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"0"})) << report;
  EXPECT_NE(report.left[0].reason.find("an entry of a torch::nn::ModuleList"), std::string::npos);
  EXPECT_TRUE(list[0]->as<tnn::Conv2d>() != nullptr);

  const std::vector<std::pair<std::string, std::shared_ptr<tnn::Module>>> entries{
      {"pool", tnn::MaxPool2d(tnn::MaxPool2dOptions(2)).ptr()}};
  tnn::ModuleDict dict(entries);
  report = hierpar::nn::convert(dict);
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"pool"})) << report;
  EXPECT_NE(report.left[0].reason.find("torch::nn::ModuleDict"), std::string::npos);

  tnn::BatchNorm2d root(3);
  report = hierpar::nn::convert(root);
  ASSERT_EQ(names(report.left), (std::vector<std::string>{""})) << report;
  EXPECT_NE(report.left[0].reason.find("the root module itself"), std::string::npos);

  tnn::Sequential seq(hierpar::nn::Conv2d(tnn::Conv2dOptions(3, 4, 3)), tnn::MaxPool2d(tnn::MaxPool2dOptions(2)),
                      tnn::MaxPool2d(tnn::MaxPool2dOptions(17)));
  report = hierpar::nn::convert(seq);
  EXPECT_EQ(names(report.converted), (std::vector<std::string>{"1"})) << report;
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"0", "2"})) << report;
  EXPECT_EQ(report.left[0].reason, "already a hierpar::nn layer");
  EXPECT_NE(report.left[1].reason.find("uint8 window index"), std::string::npos);
  EXPECT_TRUE(slot_is<hierpar::nn::MaxPool2dImpl>(seq, 1));
  EXPECT_TRUE(slot_is<tnn::MaxPool2dImpl>(seq, 2));
}

TEST(ConvertSequentials, ALayerInTwoSlotsBecomesOneHierparLayer) {
  hierpar::testing::rng();
  tnn::Conv2d shared(tnn::Conv2dOptions(3, 3, 3).padding(1));
  tnn::Sequential seq(shared, tnn::Tanh(), shared);
  const auto report = hierpar::nn::convert(seq);
  EXPECT_EQ(names(report.converted), (std::vector<std::string>{"0", "2"})) << report;
  ASSERT_TRUE(slot_is<hierpar::nn::Conv2dImpl>(seq, 0));
  EXPECT_EQ(seq->ptr(0), seq->ptr(2));
}

// A Sequential inside a Sequential, as LibTorch allows it: a subclass with a forward of a fixed signature.
struct BlockImpl : tnn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Block);

TEST(ConvertSequentials, ABatchNormAndAReluAcrossASequentialBoundaryAreConvertedNotFused) {
  hierpar::testing::rng();
  Block inner(tnn::Conv2d(tnn::Conv2dOptions(3, 4, 3)), tnn::BatchNorm2d(4));
  tnn::Sequential outer(inner, relu_inplace());
  const auto report = hierpar::nn::convert(outer);
  EXPECT_EQ(names(report.converted), (std::vector<std::string>{"0.0", "0.1"})) << report;
  EXPECT_TRUE(report.fused.empty()) << report;
  EXPECT_TRUE(report.left.empty()) << report;
  EXPECT_TRUE(std::dynamic_pointer_cast<hierpar::nn::BatchNorm2dImpl>(inner->ptr(1)));
  EXPECT_TRUE(slot_is<tnn::ReLUImpl>(outer, 1));
  outer->to(torch::kDouble);
  EXPECT_EQ(outer->forward(random_tensor({2, 3, 5, 5}, torch::kDouble)).sizes(), (std::vector<int64_t>{2, 4, 3, 3}));
}

// A Sequential subclass may run its layers in another order: its layers are converted, its pairs not fused.
TEST(ConvertSequentials, ASequentialSubclassIsConvertedButNotFused) {
  hierpar::testing::rng();
  Block block(tnn::BatchNorm2d(4), relu_inplace());
  const auto report = hierpar::nn::convert(block);
  EXPECT_EQ(names(report.converted), (std::vector<std::string>{"0"})) << report;
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"1"})) << report;
  EXPECT_NE(report.left[0].reason.find("a subclass of torch::nn::Sequential"), std::string::npos)
      << report.left[0].reason;
}

TEST(ConvertSequentials, LeakyRelusThatCannotBeFusedAreReportedWithTheReason) {
  hierpar::testing::rng();
  auto conv = [] { return tnn::Conv2d(tnn::Conv2dOptions(4, 4, 1)); };
  auto leaky = [](double slope, bool inplace) {
    return tnn::LeakyReLU(tnn::LeakyReLUOptions().negative_slope(slope).inplace(inplace));
  };
  tnn::BatchNorm2d zero_weight(4);
  {
    torch::NoGradGuard no_grad;
    zero_weight->weight[2].zero_();
  }
  tnn::Sequential seq(tnn::BatchNorm2d(4), leaky(0.0, true),                   // 0, 1: slope 0
                      tnn::BatchNorm2d(4), leaky(0.2, false), tnn::ReLU(),     // 2, 3: output modified in place
                      tnn::BatchNorm2d(4), leaky(0.2, false), conv(),          // 5, 6: fused (a conv reads it)
                      zero_weight, leaky(0.2, true),                           // 8, 9: a zero in the weight
                      tnn::BatchNorm2d(4), leaky(0.2, false));                 // 10, 11: leaves the Sequential
  const auto report = hierpar::nn::convert(seq);
  EXPECT_EQ(names(report.fused), (std::vector<std::string>{"5"})) << report;
  ASSERT_EQ(names(report.left), (std::vector<std::string>{"1", "3", "9", "11"})) << report;
  EXPECT_NE(report.left[0].reason.find("negative_slope 0 is not a positive number"), std::string::npos)
      << report.left[0].reason;
  EXPECT_NE(report.left[1].reason.find("goes to a torch::nn::ReLU, which may modify it in place"), std::string::npos)
      << report.left[1].reason;
  EXPECT_NE(report.left[2].reason.find("weight has zeros"), std::string::npos) << report.left[2].reason;
  EXPECT_NE(report.left[3].reason.find("goes to the Sequential's caller"), std::string::npos) << report.left[3].reason;
  for (size_t i : {0, 2, 8, 10}) EXPECT_TRUE(slot_is<hierpar::nn::BatchNorm2dImpl>(seq, i)) << i;
  for (size_t i : {1, 3, 9, 11}) EXPECT_TRUE(slot_is<tnn::LeakyReLUImpl>(seq, i)) << i;
  EXPECT_TRUE(slot_is<hierpar::nn::BatchNormAct2dImpl>(seq, 5));
  EXPECT_TRUE(slot_is<tnn::IdentityImpl>(seq, 6));

  tnn::Sequential unfused(tnn::BatchNorm2d(4), relu_inplace());
  const auto plain = hierpar::nn::convert(unfused, hierpar::nn::ConvertOptions{/*fuse_activations=*/false});
  EXPECT_TRUE(plain.fused.empty());
  EXPECT_TRUE(slot_is<hierpar::nn::BatchNorm2dImpl>(unfused, 0));
  EXPECT_TRUE(slot_is<tnn::ReLUImpl>(unfused, 1));
}

TEST(ConvertSequentials, AConvTransposeRunsThroughTheSequentialWithOneArgument) {
  hierpar::testing::rng();
  tnn::Sequential seq(hierpar::nn::ConvTranspose2d(tnn::ConvTranspose2dOptions(3, 2, 3).stride(2)));
  seq->to(torch::kDouble);
  const auto x = random_tensor({1, 3, 4, 5}, torch::kDouble);
  EXPECT_EQ(seq->forward(x).sizes(), (std::vector<int64_t>{1, 2, 9, 11}));
}

TEST(ConvertReport, PrintsATableOfTheThreeLists) {
  hierpar::testing::rng();
  tnn::Sequential seq(tnn::Conv2d(tnn::Conv2dOptions(3, 4, 3)), tnn::BatchNorm2d(4), relu_inplace(),
                      tnn::BatchNorm2d(4), tnn::LeakyReLU(tnn::LeakyReLUOptions().negative_slope(0.0)));
  std::ostringstream os;
  os << hierpar::nn::convert(seq);
  EXPECT_EQ(os.str(),
            "hierpar::nn::convert: 3 converted, 1 fused, 1 left\n"
            "converted:\n"
            "  0  torch::nn::Conv2d       -> hierpar::nn::Conv2d\n"
            "  1  torch::nn::BatchNorm2d  -> hierpar::nn::BatchNormAct2d\n"
            "  3  torch::nn::BatchNorm2d  -> hierpar::nn::BatchNorm2d\n"
            "fused (batch norm + activation; the activation is now torch::nn::Identity):\n"
            "  1  + 2  -> hierpar::nn::BatchNormAct2d\n"
            "left:\n"
            "  4  torch::nn::LeakyReLU  not fused: negative_slope 0 is not a positive number; BatchNormAct2d's "
            "backward recovers the pre-activation by inverting the LeakyReLU, which needs a slope > 0");
}

}  // namespace
