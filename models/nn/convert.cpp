// hierpar::nn::convert and hierpar::nn::converted (convert.h): the per-layer conversions around the stock layers'
// tensors, the tree walk that replaces a Sequential's slots, the fusion decisions, and the report's table.
#include "hierpar/nn/convert.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace hierpar::nn {
namespace {

using torch::nn::Module;

// hierpar's max_pool2d records the window position in a uint8.
constexpr int64_t kMaxPoolWindow = 256;

// The type as users write it: Module::name() without the "Impl" of torch::nn's and hierpar::nn's classes.
std::string type_name(const Module& module) {
  std::string name = module.name();
  const bool ours = name.rfind("torch::nn::", 0) == 0 || name.rfind("hierpar::nn::", 0) == 0;
  if (ours && name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

std::string join(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

template <typename T>
std::string str(const T& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

// The registered tensor `key` (what optimizers and state dicts see), undefined if none is.
torch::Tensor registered(const Module& module, const std::string& key, bool buffer) {
  const auto dict = buffer ? module.named_buffers(/*recurse=*/false) : module.named_parameters(/*recurse=*/false);
  const torch::Tensor* tensor = dict.find(key);
  return tensor != nullptr ? *tensor : torch::Tensor();
}

// The stock layers convert replaces, by exact type; subclasses are `subclass`.
enum class Kind { none, conv2d, conv_transpose2d, batch_norm2d, max_pool2d, subclass, hierpar };

Kind kind_of(const Module& m) {
  const std::type_info& t = typeid(m);
  if (t == typeid(torch::nn::Conv2dImpl)) return Kind::conv2d;
  if (t == typeid(torch::nn::ConvTranspose2dImpl)) return Kind::conv_transpose2d;
  if (t == typeid(torch::nn::BatchNorm2dImpl)) return Kind::batch_norm2d;
  if (t == typeid(torch::nn::MaxPool2dImpl)) return Kind::max_pool2d;
  if (dynamic_cast<const torch::nn::Conv2dImpl*>(&m) || dynamic_cast<const torch::nn::ConvTranspose2dImpl*>(&m) ||
      dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) || dynamic_cast<const torch::nn::MaxPool2dImpl*>(&m)) {
    return Kind::subclass;
  }
  if (dynamic_cast<const Conv2dImpl*>(&m) || dynamic_cast<const ConvTranspose2dImpl*>(&m) ||
      dynamic_cast<const BatchNorm2dImpl*>(&m) || dynamic_cast<const BatchNormAct2dImpl*>(&m) ||
      dynamic_cast<const MaxPool2dImpl*>(&m)) {
    return Kind::hierpar;
  }
  return Kind::none;
}

bool convertible_kind(Kind k) { return k != Kind::none && k != Kind::subclass && k != Kind::hierpar; }

// The hierpar layer a stock one becomes, as users write it.
std::string hierpar_name(Kind k) {
  switch (k) {
    case Kind::conv2d: return "hierpar::nn::Conv2d";
    case Kind::conv_transpose2d: return "hierpar::nn::ConvTranspose2d";
    case Kind::batch_norm2d: return "hierpar::nn::BatchNorm2d";
    case Kind::max_pool2d: return "hierpar::nn::MaxPool2d";
    default: return "";
  }
}

// The stock class a subclass derives from, as users write it.
std::string stock_base_name(const Module& m) {
  if (dynamic_cast<const torch::nn::Conv2dImpl*>(&m)) return "torch::nn::Conv2d";
  if (dynamic_cast<const torch::nn::ConvTranspose2dImpl*>(&m)) return "torch::nn::ConvTranspose2d";
  if (dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return "torch::nn::BatchNorm2d";
  return "torch::nn::MaxPool2d";
}

// Why a layer of one of the four stock types (exactly) cannot become hierpar's for its own properties, or "".
std::string not_convertible(const Module& m, Kind k) {
  for (const auto& named : {m.named_parameters(/*recurse=*/false), m.named_buffers(/*recurse=*/false)}) {
    for (const auto& item : named) {
      const torch::Tensor& t = item.value();
      const auto dtype = t.scalar_type();
      if (t.is_complex() || (t.is_floating_point() && dtype != torch::kFloat && dtype != torch::kDouble &&
                             dtype != torch::kBFloat16 && dtype != torch::kHalf)) {
        return item.key() + " is " + str(dtype) + ": hierpar's ops take float32, float64, bfloat16 and float16";
      }
      if (!t.is_cpu() && !t.is_cuda() && !t.is_meta()) {
        return item.key() + " is on " + str(t.device()) + ": hierpar's ops have CPU, CUDA and Meta kernels";
      }
    }
  }
  if (k == Kind::max_pool2d) {
    const auto& o = static_cast<const torch::nn::MaxPool2dImpl&>(m).options;
    const auto& kernel = *o.kernel_size();
    const auto& padding = *o.padding();
    if (kernel[0] * kernel[1] > kMaxPoolWindow) {
      return "kernel_size " + str(o.kernel_size()) + " has " + std::to_string(kernel[0] * kernel[1]) +
             " elements per window: hierpar's uint8 window index addresses at most 256 (e.g. 16x16)";
    }
    if (padding[0] > kernel[0] / 2 || padding[1] > kernel[1] / 2) {
      return "padding " + str(o.padding()) + " is above half of kernel_size " + str(o.kernel_size()) +
             ", which hierpar's max_pool2d refuses";
    }
  }
  if (k == Kind::conv_transpose2d) {
    const auto& o = static_cast<const torch::nn::ConvTranspose2dImpl&>(m).options;
    if (!std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
      return std::string("padding_mode ") + torch::enumtype::get_enum_name(o.padding_mode()) +
             ": transposed convolutions support zeros only (stock's forward refuses it too)";
    }
  }
  return "";
}

// Throws with the reason a stock layer given to converted() cannot be converted (see convert.h).
void check_convertible(const Module& m) {
  const Kind k = kind_of(m);
  TORCH_CHECK(k != Kind::subclass, "hierpar::nn::converted: ", type_name(m), " is a subclass of ", stock_base_name(m),
              ", whose forward or state may differ from the stock layer's; convert it by hand if it is equivalent");
  const std::string why = not_convertible(m, k);
  TORCH_CHECK(why.empty(), "hierpar::nn::converted: ", type_name(m), ": ", why);
}

template <typename Layer>
Layer with_flag_of(Layer layer, const Module& stock) {
  layer->train(stock.is_training());
  return layer;
}

BatchNormTensors batch_norm_tensors(const torch::nn::BatchNorm2dImpl& stock) {
  return {registered(stock, "weight", false), registered(stock, "bias", false),
          registered(stock, "running_mean", true), registered(stock, "running_var", true),
          registered(stock, "num_batches_tracked", true)};
}

}  // namespace

// ---- one layer ------------------------------------------------------------------------------------------------

Conv2d converted(const torch::nn::Conv2d& stock) {
  check_convertible(*stock);
  const auto& o = stock->options;
  auto options = torch::nn::Conv2dOptions(o.in_channels(), o.out_channels(), o.kernel_size())
                     .stride(o.stride())
                     .padding(o.padding())
                     .dilation(o.dilation())
                     .groups(o.groups())
                     .bias(o.bias())
                     .padding_mode(o.padding_mode());
  return with_flag_of(Conv2d(options, registered(*stock, "weight", false), registered(*stock, "bias", false)), *stock);
}

ConvTranspose2d converted(const torch::nn::ConvTranspose2d& stock) {
  check_convertible(*stock);
  const auto& o = stock->options;
  // A stock transposed convolution holds explicit padding only (its constructor refuses kValid and kSame).
  auto options = torch::nn::ConvTranspose2dOptions(o.in_channels(), o.out_channels(), o.kernel_size())
                     .stride(o.stride())
                     .padding(std::get<torch::ExpandingArray<2>>(o.padding()))
                     .output_padding(o.output_padding())
                     .groups(o.groups())
                     .bias(o.bias())
                     .dilation(o.dilation())
                     .padding_mode(o.padding_mode());
  return with_flag_of(
      ConvTranspose2d(options, registered(*stock, "weight", false), registered(*stock, "bias", false)), *stock);
}

BatchNorm2d converted(const torch::nn::BatchNorm2d& stock) {
  check_convertible(*stock);
  return with_flag_of(BatchNorm2d(stock->options, batch_norm_tensors(*stock)), *stock);
}

BatchNormAct2d converted(const torch::nn::BatchNorm2d& stock, Activation activation, double negative_slope) {
  check_convertible(*stock);
  return with_flag_of(BatchNormAct2d(stock->options, activation, negative_slope, batch_norm_tensors(*stock)), *stock);
}

MaxPool2d converted(const torch::nn::MaxPool2d& stock) {
  check_convertible(*stock);
  return with_flag_of(MaxPool2d(stock->options), *stock);
}

// ---- the tree -------------------------------------------------------------------------------------------------

namespace {

// Modules that read their input without writing it: a LeakyReLU(inplace false) followed by one of these hands its
// output to nothing that modifies it in place (see unfusable).
bool reads_input_only(const Module& m) {
  if (const auto* dropout = dynamic_cast<const torch::nn::DropoutImpl*>(&m)) return !dropout->options.inplace();
  if (const auto* dropout = dynamic_cast<const torch::nn::Dropout2dImpl*>(&m)) return !dropout->options.inplace();
  const Kind k = kind_of(m);
  if (k != Kind::none) return true;  // the convolutions, batch norms and max pools, stock and hierpar's
  return dynamic_cast<const torch::nn::Conv1dImpl*>(&m) || dynamic_cast<const torch::nn::Conv3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::ConvTranspose1dImpl*>(&m) ||
         dynamic_cast<const torch::nn::ConvTranspose3dImpl*>(&m) || dynamic_cast<const torch::nn::LinearImpl*>(&m) ||
         dynamic_cast<const torch::nn::MaxPool1dImpl*>(&m) || dynamic_cast<const torch::nn::MaxPool3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::AvgPool1dImpl*>(&m) || dynamic_cast<const torch::nn::AvgPool2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::AvgPool3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::AdaptiveAvgPool2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::AdaptiveMaxPool2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) ||
         dynamic_cast<const torch::nn::FlattenImpl*>(&m) || dynamic_cast<const torch::nn::UpsampleImpl*>(&m) ||
         dynamic_cast<const torch::nn::TanhImpl*>(&m) || dynamic_cast<const torch::nn::SigmoidImpl*>(&m);
}

// Why BatchNorm2d `bn` (convertible) followed by `activation` (a ReLU or LeakyReLU) and then by `following` (null:
// the Sequential's end) is not fused, or "".
std::string unfusable(const Module& bn, const Module& activation, const Module* following) {
  const auto* leaky = dynamic_cast<const torch::nn::LeakyReLUImpl*>(&activation);
  if (leaky == nullptr) return "";  // ReLU: BatchNormAct2d(relu) keeps its input and output, as stock's pair does
  const double slope = leaky->options.negative_slope();
  if (!(slope > 0) || !std::isfinite(slope)) {
    return "not fused: negative_slope " + str(slope) +
           " is not a positive number; BatchNormAct2d's backward recovers the pre-activation by inverting the "
           "LeakyReLU, which needs a slope > 0";
  }
  const torch::Tensor weight = registered(bn, "weight", false);
  if (weight.defined() && !weight.is_meta() && (weight == 0).any().item<bool>()) {
    return "not fused: the batch norm's weight has zeros; BatchNormAct2d(leaky_relu) recovers xhat from its output, "
           "which a zero weight makes impossible (that channel's grad_weight would be NaN)";
  }
  if (!leaky->options.inplace() && (following == nullptr || !reads_input_only(*following))) {
    // Stock LeakyReLU(inplace false) keeps its input for backward, so its output may be modified in place
    // afterwards; BatchNormAct2d(leaky_relu) keeps its output, which autograd would then refuse to use.
    return "not fused: a LeakyReLU(inplace=false) whose output goes to " +
           (following == nullptr ? std::string("the Sequential's caller") : "a " + type_name(*following)) +
           ", which may modify it in place; BatchNormAct2d(leaky_relu) keeps its output for backward, so autograd "
           "would then refuse the backward where stock's LeakyReLU (keeping its input) does not";
  }
  return "";
}

// Where a layer sits, for the reason it is left.
enum class Position { sequential, list, dict, member, root };

std::string position_reason(Position where, const Module& parent, const std::string& hierpar) {
  switch (where) {
    case Position::list:
    case Position::dict:
      return std::string("an entry of a ") +
             (where == Position::list ? "torch::nn::ModuleList" : "torch::nn::ModuleDict") +
             ", whose callers cast entries to the stock type (a replacement would cast to null): build it with " +
             hierpar + ", or replace the entry by hand with hierpar::nn::converted(...)";
    case Position::root:
      return "the root module itself, which the caller holds: use hierpar::nn::converted(...)";
    default:
      return "a member of " + type_name(parent) +
             ", whose forward calls its own holder, which convert cannot rebind (a replaced registry entry would "
             "never run): declare it as " + hierpar +
             " (same options), or assign it replace_module(name, hierpar::nn::converted(...))";
  }
}

Position position_in(const Module& parent) {
  if (dynamic_cast<const torch::nn::SequentialImpl*>(&parent)) return Position::sequential;
  if (dynamic_cast<const torch::nn::ModuleListImpl*>(&parent)) return Position::list;
  if (dynamic_cast<const torch::nn::ModuleDictImpl*>(&parent)) return Position::dict;
  return Position::member;
}

class Converter {
 public:
  explicit Converter(ConvertOptions options) : options_(options) {}

  void visit(const std::shared_ptr<Module>& module, const std::string& name);
  // The replacement for `m` where it is a stock layer convert replaces at `where`, else nothing (and `m` is reported
  // in `left` where it is a layer of those kinds: stock, a subclass, or already hierpar's).
  std::optional<torch::nn::AnyModule> replacement(const std::shared_ptr<Module>& m, const std::string& name,
                                                  const Module& parent, Position where);
  ConversionReport report;

 private:
  void sequential(torch::nn::SequentialImpl& seq, const std::string& prefix);
  bool fuse(torch::nn::SequentialImpl& seq, std::vector<torch::nn::AnyModule*>& slots,
            const std::vector<std::string>& keys, size_t i, const std::string& prefix);

  ConvertOptions options_;
  std::unordered_set<const Module*> visited_;
  std::unordered_map<const Module*, torch::nn::AnyModule> done_;  // a stock layer -> its replacement (shared layers)
};

torch::nn::AnyModule convert_layer(const std::shared_ptr<Module>& m, Kind k) {
  switch (k) {
    case Kind::conv2d:
      return torch::nn::AnyModule(converted(torch::nn::Conv2d(std::static_pointer_cast<torch::nn::Conv2dImpl>(m))));
    case Kind::conv_transpose2d:
      return torch::nn::AnyModule(
          converted(torch::nn::ConvTranspose2d(std::static_pointer_cast<torch::nn::ConvTranspose2dImpl>(m))));
    case Kind::batch_norm2d:
      return torch::nn::AnyModule(
          converted(torch::nn::BatchNorm2d(std::static_pointer_cast<torch::nn::BatchNorm2dImpl>(m))));
    default:
      return torch::nn::AnyModule(
          converted(torch::nn::MaxPool2d(std::static_pointer_cast<torch::nn::MaxPool2dImpl>(m))));
  }
}

std::optional<torch::nn::AnyModule> Converter::replacement(const std::shared_ptr<Module>& m, const std::string& name,
                                                           const Module& parent, Position where) {
  const Kind k = kind_of(*m);
  if (k == Kind::none) return std::nullopt;
  std::string why;
  if (k == Kind::hierpar) {
    why = "already a hierpar::nn layer";
  } else if (k == Kind::subclass) {
    why = "a subclass of " + stock_base_name(*m) + ", whose forward or state may differ from the stock layer's that " +
          "hierpar::nn's reproduces; replace it by hand if it is equivalent";
  } else if (const auto it = done_.find(m.get()); it != done_.end() && where == Position::sequential) {
    report.converted.push_back({name, type_name(*m), type_name(*it->second.ptr()), "", ""});
    return it->second;
  } else {
    why = not_convertible(*m, k);
    if (why.empty() && where != Position::sequential) why = position_reason(where, parent, hierpar_name(k));
  }
  if (!why.empty()) {
    report.left.push_back({name, type_name(*m), "", "", why});
    return std::nullopt;
  }
  auto any = convert_layer(m, k);
  done_.emplace(m.get(), any);
  report.converted.push_back({name, type_name(*m), type_name(*any.ptr()), "", ""});
  return any;
}

// Replaces slot `slot` of `seq` (registered as `key`): both the list Sequential::forward runs and the registry that
// children(), named_parameters() and state dicts read.
void replace_slot(torch::nn::SequentialImpl& seq, const std::string& key, torch::nn::AnyModule& slot,
                  torch::nn::AnyModule replacement) {
  seq.replace_module(key, replacement.ptr());
  slot = std::move(replacement);
}

bool Converter::fuse(torch::nn::SequentialImpl& seq, std::vector<torch::nn::AnyModule*>& slots,
                     const std::vector<std::string>& keys, size_t i, const std::string& prefix) {
  const std::shared_ptr<Module> bn = slots[i]->ptr(), act = slots[i + 1]->ptr();
  const Module& act_module = *act;
  const std::type_info& act_type = typeid(act_module);
  const bool relu = act_type == typeid(torch::nn::ReLUImpl);
  if (kind_of(*bn) != Kind::batch_norm2d || !not_convertible(*bn, Kind::batch_norm2d).empty() ||
      (!relu && act_type != typeid(torch::nn::LeakyReLUImpl))) {
    return false;
  }
  const std::string act_name = join(prefix, keys[i + 1]);
  const Module& seq_module = seq;
  const std::string why =
      typeid(seq_module) != typeid(torch::nn::SequentialImpl)
          ? "not fused: a subclass of torch::nn::Sequential (" + type_name(seq) +
                "), whose own forward may not run its layers in order"
          : unfusable(*bn, *act, i + 2 < slots.size() ? slots[i + 2]->ptr().get() : nullptr);
  if (!why.empty()) {
    report.left.push_back({act_name, type_name(*act), "", "", why});
    return false;
  }
  const torch::nn::BatchNorm2d stock(std::static_pointer_cast<torch::nn::BatchNorm2dImpl>(bn));
  const double slope = relu ? 0.01 : std::static_pointer_cast<torch::nn::LeakyReLUImpl>(act)->options.negative_slope();
  auto fused = converted(stock, relu ? Activation::relu : Activation::leaky_relu, slope);
  torch::nn::Identity identity;
  identity->train(act->is_training());
  const std::string name = join(prefix, keys[i]);
  report.converted.push_back({name, type_name(*bn), type_name(*fused), "", ""});
  report.fused.push_back({name, type_name(*bn) + " + " + type_name(*act), type_name(*fused), act_name, ""});
  replace_slot(seq, keys[i], *slots[i], torch::nn::AnyModule(fused));
  replace_slot(seq, keys[i + 1], *slots[i + 1], torch::nn::AnyModule(identity));
  return true;
}

void Converter::sequential(torch::nn::SequentialImpl& seq, const std::string& prefix) {
  const auto children = seq.named_children();
  std::vector<torch::nn::AnyModule*> slots;
  for (auto& slot : seq) slots.push_back(&slot);
  // Sequential keeps its registry and its list in step (push_back adds to both); replace_module on it would not.
  bool in_step = slots.size() == children.size();
  for (size_t i = 0; in_step && i < slots.size(); ++i) in_step = slots[i]->ptr() == children[i].value();
  std::vector<std::string> keys;
  for (const auto& item : children) keys.push_back(item.key());
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string name = join(prefix, keys[i]);
    if (!in_step) {
      if (convertible_kind(kind_of(*children[i].value()))) {
        report.left.push_back({name, type_name(*children[i].value()), "", "",
                               "its Sequential's registry and call list disagree (replace_module was called on it), "
                               "so which one forward runs is unclear"});
      }
      continue;
    }
    if (options_.fuse_activations && i + 1 < slots.size() && fuse(seq, slots, keys, i, prefix)) {
      ++i;
      continue;
    }
    if (auto any = replacement(slots[i]->ptr(), name, seq, Position::sequential)) {
      replace_slot(seq, keys[i], *slots[i], std::move(*any));
    }
  }
}

void Converter::visit(const std::shared_ptr<Module>& module, const std::string& name) {
  if (!visited_.insert(module.get()).second) return;  // a module reached twice is converted once
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(module.get())) {
    sequential(*seq, name);
  } else {
    const Position where = position_in(*module);
    for (const auto& item : module->named_children()) replacement(item.value(), join(name, item.key()), *module, where);
  }
  for (const auto& item : module->named_children()) visit(item.value(), join(name, item.key()));
}

// Pads `cells` to their column's width (the last column is not padded).
void print_table(std::ostream& os, const std::vector<std::vector<std::string>>& rows) {
  if (rows.empty()) return;
  std::vector<size_t> widths(rows[0].size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c + 1 < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    os << "\n ";
    for (size_t c = 0; c < row.size(); ++c) {
      os << " " << row[c];
      if (c + 1 < row.size()) os << std::string(widths[c] - row[c].size() + 1, ' ');
    }
  }
}

std::string shown(const std::string& name) { return name.empty() ? "(root)" : name; }

}  // namespace

ConversionReport convert(const std::shared_ptr<torch::nn::Module>& module, ConvertOptions options) {
  TORCH_CHECK(module != nullptr, "hierpar::nn::convert: module: expected a module, got a null pointer");
  Converter converter(options);
  // The root cannot be replaced (the caller holds it); a stock layer there is reported.
  converter.replacement(module, "", *module, Position::root);
  converter.visit(module, "");
  return std::move(converter.report);
}

std::ostream& operator<<(std::ostream& os, const ConversionReport& report) {
  os << "hierpar::nn::convert: " << report.converted.size() << " converted, " << report.fused.size() << " fused, "
     << report.left.size() << " left";
  std::vector<std::vector<std::string>> rows;
  if (!report.converted.empty()) {
    os << "\nconverted:";
    for (const auto& e : report.converted) rows.push_back({shown(e.name), e.from, "-> " + e.to});
    print_table(os, rows);
  }
  if (!report.fused.empty()) {
    os << "\nfused (batch norm + activation; the activation is now torch::nn::Identity):";
    rows.clear();
    for (const auto& e : report.fused) rows.push_back({shown(e.name), "+ " + e.activation, "-> " + e.to});
    print_table(os, rows);
  }
  if (!report.left.empty()) {
    os << "\nleft:";
    rows.clear();
    for (const auto& e : report.left) rows.push_back({shown(e.name), e.from, e.reason});
    print_table(os, rows);
  }
  return os;
}

}  // namespace hierpar::nn
