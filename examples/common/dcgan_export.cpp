// The generator of a checkpoint: loaded for sampling, or exported as TorchScript (declared in dcgan_app.h).
#include "common/cli.h"
#include "common/dcgan_app.h"

#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/nn/modules/batchnorm.h>

#include <memory>
#include <sstream>

namespace hierpar::examples {
namespace {

// Resolves the names TorchScript source written here may use: `torch` (aten builtins) and `ops`, whose
// attributes are operator namespaces (ops.hierpar.conv_transpose2d), as in TorchScript's own serialised code.
struct OpsNamespaces : torch::jit::SugaredValue {
  std::string kind() const override { return "operator namespaces"; }
  std::shared_ptr<torch::jit::SugaredValue> attr(const torch::jit::SourceRange&, torch::jit::GraphFunction&,
                                                 const std::string& field) override {
    return std::make_shared<torch::jit::BuiltinModule>(field);
  }
};

struct ExportResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction&,
                                                         const torch::jit::SourceRange&) override {
    if (name == "torch") return std::make_shared<torch::jit::BuiltinModule>("aten");
    if (name == "ops") return std::make_shared<OpsNamespaces>();
    return nullptr;
  }
  c10::TypePtr resolveType(const std::string&, const torch::jit::SourceRange&) override { return nullptr; }
};

// The DCGAN shape in `state`, the configuration of the checkpoint at `checkpoint` (named in errors).
models::DCGANOptions model_of(const CheckpointState& state, const std::string& checkpoint, LayerSet layers) {
  auto field = [&](const char* key) {
    auto it = state.config.find(key);
    if (it == state.config.end()) throw Error(checkpoint + ": the configuration has no " + key);
    return it->second;
  };
  models::DCGANOptions options;
  options.nz = std::stoll(field("nz"));
  options.image_size = std::stoll(field("image_size"));
  options.channels = std::stoll(field("channels"));
  options.width = std::stod(field("width"));
  options.layers = layers;
  return options;
}

}  // namespace

models::DCGANOptions checkpoint_model(const std::string& checkpoint, LayerSet layers) {
  return model_of(read_checkpoint_state(checkpoint), checkpoint, layers);
}

models::Generator load_generator(const std::string& checkpoint, LayerSet layers, torch::Device device,
                                 const std::string& weights) {
  if (weights != "live" && weights != "ema") throw FlagError("--weights: expected live or ema, got '" + weights + "'");
  const CheckpointState state = read_checkpoint_state(checkpoint);
  if (weights == "ema" && state.config.count("ema") == 0)
    throw Error(checkpoint + " has no moving average of G's weights: it was trained without --ema");
  models::Generator generator(model_of(state, checkpoint, layers));
  load_checkpoint(checkpoint, {}, {{weights == "ema" ? "generator_ema" : "generator", generator.get()}}, {}, device,
                  /*restore_rng=*/false);
  generator->to(device);
  generator->eval();
  return generator;
}

torch::jit::Module export_generator(models::GeneratorImpl& generator, ExportOps ops) {
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module module(c10::QualifiedName("__torch__.hierpar.DCGANGenerator"), cu);
  const double eps = torch::nn::BatchNorm2dOptions(1).eps();
  std::ostringstream src;
  src << "def forward(self, z):\n"
      << "    x = z.reshape([z.size(0), " << generator.options.nz << ", 1, 1])\n";
  const auto children = generator.named_children();
  for (const auto& child : children) {
    const std::string& name = child.key();
    const bool hierpar = ops == ExportOps::hierpar ||
                         (ops == ExportOps::as_built && child.value()->name().rfind("hierpar::", 0) == 0);
    torch::jit::Module sub(c10::QualifiedName("__torch__.hierpar.DCGANGenerator_" + name), cu);
    for (const auto& p : child.value()->named_parameters(false)) sub.register_parameter(p.key(), p.value().detach(), false);
    for (const auto& b : child.value()->named_buffers(false)) sub.register_buffer(b.key(), b.value().detach());
    module.register_module(name, sub);
    const std::string self = "self." + name;
    if (name.rfind("deconv", 0) == 0) {
      const bool first = name == "deconv1";
      const std::string geometry = first ? "[1, 1], [0, 0]" : "[2, 2], [1, 1]";
      if (hierpar) {
        src << "    x = ops.hierpar.conv_transpose2d(x, " << self << ".weight, None, " << geometry
            << ", [0, 0], 1, [1, 1])\n";
      } else {
        src << "    x = torch.conv_transpose2d(x, " << self << ".weight, None, " << geometry << ")\n";
      }
    } else {
      const std::string args = self + ".weight, " + self + ".bias, " + self + ".running_mean, " + self +
                               ".running_var, False, 0.1, " + format_number(eps);
      if (hierpar) {
        src << "    x = ops.hierpar.batch_norm_act(x, " << args << ", \"relu\", 0.0)[0]\n";
      } else {
        src << "    x = torch.relu(torch.batch_norm(x, " << args << ", False))\n";
      }
    }
  }
  src << "    return torch.tanh(x)\n";
  module.define(src.str(), std::make_shared<ExportResolver>());
  module.eval();
  return module;
}

}  // namespace hierpar::examples
