#include "hierpar/strategy/graphed_step.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <sstream>
#include <utility>

namespace hierpar::strategy {
namespace {

// What the operators a capture ran looked like, seen through a thread-local RecordFunction callback (autograd's
// threads inherit it with the rest of the thread-local state, so the backward's operators are seen too).
struct CaptureWatch {
  bool refuse_cpu_tensors = true;
  std::mutex mutex;
  std::string outermost, innermost;  // the latest operator entered at depth 0, and the latest of all
  std::string cpu_operator;          // the first operator given a CPU tensor (of at least one dimension)
};
CaptureWatch* active_watch = nullptr;  // the capture under way (one at a time: see WatchScope)
std::mutex active_watch_mutex;
thread_local int operator_depth = 0;

bool takes_cpu_tensor(const at::RecordFunction& fn) {
  for (const c10::IValue& value : fn.inputs()) {
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (t.defined() && t.device().is_cpu() && t.dim() > 0) return true;
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) {
        if (t.defined() && t.device().is_cpu() && t.dim() > 0) return true;
      }
    }
  }
  return false;
}

std::unique_ptr<at::ObserverContext> on_operator_enter(const at::RecordFunction& fn) {
  CaptureWatch* watch = active_watch;
  const int depth = operator_depth++;
  if (!watch) return nullptr;
  const std::lock_guard<std::mutex> lock(watch->mutex);
  watch->innermost = fn.name();
  if (depth == 0) watch->outermost = fn.name();
  if (watch->refuse_cpu_tensors && watch->cpu_operator.empty() && takes_cpu_tensor(fn)) watch->cpu_operator = fn.name();
  return nullptr;
}

void on_operator_exit(const at::RecordFunction&, at::ObserverContext*) { --operator_depth; }

// Watches the operators run on this thread (and its autograd threads) while it lives.
class WatchScope {
 public:
  explicit WatchScope(CaptureWatch& watch) : lock_(active_watch_mutex) {
    active_watch = &watch;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_operator_enter, &on_operator_exit)
                                             .needsInputs(watch.refuse_cpu_tensors)
                                             .scopes({at::RecordScope::FUNCTION}));
  }
  ~WatchScope() {
    at::removeCallback(handle_);
    active_watch = nullptr;
  }
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;

 private:
  std::unique_lock<std::mutex> lock_;
  at::CallbackHandle handle_{};
};

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

std::string operator_named(const CaptureWatch& watch) {
  if (watch.outermost.empty()) return "the body (before any operator)";
  if (watch.innermost.empty() || watch.innermost == watch.outermost) return watch.outermost;
  return watch.outermost + " (in " + watch.innermost + ")";
}

}  // namespace

GraphedStep::GraphedStep(std::function<void()> body, c10::Device device, GraphedStepOptions options)
    : body_(std::move(body)), options_(options) {
  TORCH_CHECK(body_, "GraphedStep: body: expected a function, got an empty one");
  TORCH_CHECK(options_.warm_up_steps >= 1, "GraphedStep: warm_up_steps: expected at least 1 (the capture must not be "
              "the body's first run), got ", options_.warm_up_steps);
  TORCH_CHECK(cuda_graphs_available(), "GraphedStep: CUDA graphs need a CUDA build of hierpar and a visible GPU");
  captured_ = std::make_unique<CapturedStep>(device);
}

GraphedStep::~GraphedStep() = default;

void GraphedStep::operator()() {
  if (!captured_->captured()) {
    if (steps_ < options_.warm_up_steps) {
      captured_->warm_up(body_);
      ++steps_;
      return;
    }
    capture();
  }
  captured_->replay(0);
  ++steps_;
}

void GraphedStep::capture() {
  release_cached_memory_before_capture();
  CaptureWatch watch;
  watch.refuse_cpu_tensors = options_.refuse_cpu_tensors;
  try {
    const WatchScope scope(watch);
    captured_->capture(body_);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "GraphedStep: the step's body cannot be captured into a CUDA graph at ", operator_named(watch),
                ": ", first_line(e.what_without_backtrace()),
                " (a host read such as .item() or printing a tensor, a synchronisation, or a host-side optimiser step "
                "cannot be captured: docs/user_loop.md)");
  }
  if (!watch.cpu_operator.empty()) {
    captured_->abandon_capture();
    TORCH_CHECK(false, "GraphedStep: the step's body ran ", watch.cpu_operator, " on a CPU tensor while being "
                "captured: CPU work runs once, at capture, and never at replay. Keep the body's tensors on the device "
                "(fill a static input buffer before each step), or set GraphedStepOptions::refuse_cpu_tensors = false "
                "if that work is meant to run once");
  }
}

bool GraphedStep::captured() const { return captured_->captured(); }

int64_t GraphedStep::kernel_nodes() const { return captured_->captured() ? captured_->kernel_nodes() : 0; }

}  // namespace hierpar::strategy
