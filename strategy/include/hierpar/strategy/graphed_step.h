// GraphedStep: the body of a user's own training loop (forward, backward, optimiser steps, noise and label draws)
// run as CUDA graphs, the C++ counterpart of torch.cuda.graph's whole-step recipe. The first calls run the body
// eagerly on a side stream (warm-up: lazy initialisations, cuDNN's algorithm search, the optimiser's state), the
// next one captures it and replays it, every later one replays it: one launch per step instead of hundreds.
//
//   auto real = torch::empty({batch, 3, 64, 64}, cuda);              // static input: the body reads it
//   hierpar::optim::Adam opt_d(d->parameters(), options), opt_g(...);  // capturable optimisers
//   hierpar::strategy::GraphedStep step([&] { ...the loop's body, reading `real`... }, cuda);
//   for (auto& batch : *loader) { real.copy_(batch.data); step(); }
//
// What a captured body must keep (docs/user_loop.md): the same shapes every step (a static input buffer of the batch's
// size: drop or pad a last short batch); tensors on the device (no host read such as .item() or printing a tensor,
// no CPU tensor work: it would run once, at capture); an optimiser whose step stays on the device
// (hierpar::optim::Adam; torch::optim::Adam keeps its step count on the host, so a replay would repeat the captured
// step's bias correction). Random draws (torch::randn, uniform_) are graph-safe: each replay draws new numbers. A
// body that cannot be captured fails with one line naming the operator. AdversarialTrainer captures its step with the
// same CapturedStep.
#pragma once

#include "hierpar/strategy/captured_step.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace hierpar::strategy {

struct GraphedStepOptions {
  // Eager runs of the body before the capture (at least 1: the capture must not be the body's first run).
  int64_t warm_up_steps = 3;
  // While capturing, refuse operators on CPU tensors (other than 0-dim ones, ATen's wrapped scalars): they run once
  // at capture and never at replay. A host read fails the capture regardless.
  bool refuse_cpu_tensors = true;
};

class GraphedStep {
 public:
  // `body`: one step of work on `device` (a CUDA device), enqueue-only once warmed up. Throws on a build or machine
  // without CUDA, and when options.warm_up_steps < 1.
  GraphedStep(std::function<void()> body, c10::Device device, GraphedStepOptions options = {});
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;

  // One step: a warm-up run, the capture (then its replay), or a replay, on the current stream's order. A failed
  // capture throws a c10::Error naming the operator that could not be captured; the step can be called again
  // (it then captures again).
  void operator()();

  bool captured() const;
  int64_t steps() const { return steps_; }  // calls so far, warm-up included
  int64_t kernel_nodes() const;             // kernels in the captured graph (0 before the capture)

 private:
  void capture();

  std::function<void()> body_;
  GraphedStepOptions options_;
  int64_t steps_ = 0;
  std::unique_ptr<CapturedStep> captured_;
};

}  // namespace hierpar::strategy
