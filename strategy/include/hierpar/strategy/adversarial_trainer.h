// Two-network adversarial training (a generator G and a discriminator D, any modules) under a Placement.
// One step is the standard DCGAN recipe, per replica on its share of the batch:
//   fake = G(z); D on real, and its backward; D on fake.detach(), and its backward (D's gradients are the sum
//   of the two); average D's gradients; D update; D on fake (D's updated weights, frozen) for G's loss, backward
//   to the fakes; G's backward from that gradient; average G's gradients; G update.
// G's part (forward, backward, update) runs on G's device and D's part on D's. Under task/hierarchical
// placements the fakes go to D's device and their gradient back by ATen's device-to-device copies, which order
// the two devices' streams with CUDA events; the host never waits inside a step except where host averaging must
// read the gradients. D's pass over the real batch needs no fakes, so D's device runs it while G's device runs
// G's backward and update of the previous step and G's forward: the two devices overlap by as much as the recipe
// allows, with the numbers of a single-device step.
// Each step writes its losses into a small buffer on the device; take_losses() reads them back (one host
// sync), and step() does so itself only when `loss_log_steps` steps are pending. Nothing else reads a value
// on the host.
//
// CUDA graphs (options.cuda_graphs, with options.fused_adam): each replica's step is captured once and replayed
// every step. The first `graph_warmup_steps` steps run eagerly on side streams (they are real steps); the next
// is captured and replayed; from then on a step is a copy of the batch into a static input buffer and the
// replays. The noise is drawn inside the graph from G's device's default CUDA generator (graph-safe: the same
// numbers as an eager step would draw), the optimisers are FusedAdam (capturable), the losses go to the device
// buffer. Each device's part is captured on that device as segments (graphs) that end where the step moves to
// the other device or averages outside the graphs; the replay runs them in the step's order with the copies
// between devices and that averaging in between, eagerly. NCCL averaging is captured: the buckets' all-reduces
// are nodes of the backward's graph (AveragingOptions::capture_collectives), so a data-parallel step is one graph
// per replica. Host averaging sums on CPU threads between the segments, from one flat buffer per network or, with
// AveragingOptions::capture_host_copies, from bucket copies captured in the backward's graph (graph_averaging()).
// Synchronized BatchNorm is not captured (graph_fallback() says so).
//
// One process per device (a split placement, placement.h's ReplicaPart: torchrun --nproc-per-node 2 for task): G's
// process runs G's pieces and D's process D's; the fakes go to D's process and their gradient back over a two-rank
// process group (NCCL broadcasts on CUDA, Gloo on the CPU) where the in-process step copies between devices, and
// each network averages over the processes that run it. The losses are D's process's: take_losses() brings them to
// G's, step()'s StepLosses there are empty, and generator()/discriminator() and their optimisers exist only in the
// process that runs that network. Every process calls step() and take_losses() at the same steps.
//
// Two streams on one device (options.overlap_passes; single and data placements on CUDA; captured steps, and eager ones
// from options.eager_overlap_batch): G's forward and D's pass over the fakes run on a second stream, so they overlap
// D's pass over the real batch and its backward (autograd runs a node's backward on its forward's stream; captured,
// from kJointDiscriminatorBackwardBatch images, without a penalty, D's two branches are one backward call). The fakes'
// pass through D waits for the real batch's forward, which updates D's BatchNorm running statistics first, as one
// stream would. Same numbers as one stream in fp32; under autocast each D pass casts D's weights itself (no cast shared
// across the streams), which sums D's two weight gradients in fp32. The trainer's first step runs on one stream
// (cuDNN's benchmark mode times its algorithms there), and the trainer turns off autograd's warning about
// AccumulateGrad streams (D's gradients from the second stream accumulate on the main one by design).
//
// Usage (a DCGAN example):
//   auto placement = hierpar::strategy::Placement::from_flags(strategy, gpus, reduce);
//   std::cout << placement << "\n";
//   hierpar::strategy::AdversarialTrainer trainer(torch::nn::AnyModule(generator),
//                                                 torch::nn::AnyModule(discriminator), placement, options);
//   trainer.step(real_batch);                          // this process's share of the global batch
//   if (i % 50 == 0) auto losses = trainer.take_losses();  // [steps, 3] on the CPU: the only host sync
#pragma once

#include "hierpar/strategy/averaging.h"
#include "hierpar/strategy/fused_adam.h"
#include "hierpar/strategy/losses.h"
#include "hierpar/strategy/placement.h"
#include "hierpar/strategy/precision.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/nn/modules/container/any.h>
#include <torch/optim/adam.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace hierpar::strategy {
namespace detail {
class PartLink;
}

struct AdamSettings {
  double lr = 2e-4;
  double beta1 = 0.5;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// The order of G's and D's work in a step (docs/strategy.md, "Schedules").
// exact: the DCGAN recipe; every placement computes the numbers of one device.
// pipelined: G runs one step ahead. Its forward for step t + 1 runs during step t, on its weights before step t's
// update (held in one of two copies of G until that step's backward), so D never waits for G's update and on two
// devices G's forward overlaps D's work. This changes the algorithm: G's gradient at step t is taken at its weights
// of step t - 1 and applied to those of step t (PipeDream's weight stashing). Eager steps only (graph_fallback() says
// so under cuda_graphs), in-process placements, noise drawn by the trainer (step(real)), flat averaging after the
// backward, no synchronized BatchNorm. A checkpoint holds no fakes in flight: a resumed run refills the pipeline.
enum class Schedule { exact, pipelined };
const char* to_string(Schedule schedule);
Schedule parse_schedule(const std::string& name);  // "exact" | "pipelined"

// From this batch per replica, one device's captured, overlapped step (cuda_graphs, overlap_passes, no penalty) runs
// D's backward over the real batch and over the fakes as one autograd call; below it, and in eager steps, the fakes'
// backward is its own call from the fakes' stream. Graphs on an H100: batch 1024 bf16 3.65 ms a step joined against
// 3.68-3.75 apart; batch 64 TF32 1.37-1.40 ms joined against 1.36-1.37 apart. Joined, the real pass's activations
// live until the fakes' pass has made its own: 14-24% more peak memory at batch 1024-4096 (docs/training_step.md).
inline constexpr int64_t kJointDiscriminatorBackwardBatch = 512;

// Eager steps (no cuda_graphs) overlap the passes on two streams from this batch per replica. Below it the
// launches, not the kernels, bound an eager step, and the second stream's events and switches cost more host time
// than the overlap saves; above it the kernels are long enough to overlap. Two H200s, TF32 NCHW eager, ms a step on
// one stream / two: 5.54 / 6.77 at batch 64, 5.33 / 6.28 at 256, 10.81 / 10.16 at 1024, 38.85 / 37.95 at 4096 (the
// other precisions and layouts alike; docs/training_step.md).
inline constexpr int64_t kEagerOverlapBatch = 1024;

struct AdversarialOptions {
  AdamSettings generator_adam;
  AdamSettings discriminator_adam;
  // The shape of one noise sample, drawn N(0, 1) when step() is given no noise: every replica draws the
  // noise of the whole global batch on its G device and keeps its own rows (the same numbers as one draw
  // split over the replicas while the devices' generators share seed and state, as manual_seed_all leaves
  // them); replicas sharing one generator (CPU) get their rows of one draw made before they start.
  std::vector<int64_t> noise_shape{100, 1, 1};
  AdversarialLoss loss = bce_with_logits_loss;
  AveragingOptions averaging;
  // hierpar::strategy::FusedAdam (a torch::optim::Adam whose step is two fused kernels per network and
  // device, capturable) instead of torch::optim::Adam. Required by cuda_graphs.
  bool fused_adam = false;
  // Its kernel (fused_adam.h): hierpar's, or ATen's for a stock baseline.
  AdamKernel fused_adam_kernel = AdamKernel::hierpar;
  // Capture each replica's step as CUDA graphs and replay them (see the top of this file), on every placement.
  // Needs CUDA devices; synchronized BatchNorm over several replicas falls back to eager steps.
  bool cuda_graphs = false;
  int64_t graph_warmup_steps = 3;
  // The steps that may run far longer than later ones (cuDNN's autotuning in the eager warm-up, the capture, the
  // first replay; without graphs the first step): the trainer's and a RunGuard's hang bounds are looser there.
  int64_t startup_steps() const { return cuda_graphs ? graph_warmup_steps + 2 : 1; }
  // How the step computes (precision.h): fp32, tf32 (TF32 convolutions and matmuls on CUDA) or bf16 autocast of the
  // forward passes and losses, and whether 4-d parameters and the real batches are channels_last (the activations
  // follow). Applied around every step as a PrecisionScope (ATen's TF32 switches are process-wide: set for the step,
  // restored after). The default is plain float32, whatever ATen's own defaults.
  StepPrecision precision;
  // > 0: an exponential moving average of G's parameters, ema = decay * ema + (1 - decay) * p after each G
  // update, starting from the initial parameters (generator_ema()); the GAN practice of sampling and evaluating
  // from averaged weights. Part of the step: on G's device, in the captured graph too. In [0, 1).
  double generator_ema_decay = 0.0;
  // R1 regularisation of D (Mescheder et al., 2018; StyleGAN's): r1_gamma / 2 times the mean over the real batch of
  // the squared norm of the gradient of D's logits (their sum, as StyleGAN computes it) with respect to the images,
  // added to D's loss on the real batch. Lazy, as StyleGAN2: on every r1_every-th step (the first included), scaled by
  // r1_every. It differentiates a gradient, which both layer sets support (hierpar's BatchNorm keeps its input for
  // these passes: hierpar::ops::DoubleBackwardScope). The logged D losses do not include it. A captured step would
  // run it on every step or on none: with cuda_graphs the steps run eagerly and graph_fallback() says so. Not with
  // synchronized BatchNorm. 0: off.
  double r1_gamma = 0.0;
  int64_t r1_every = 16;
  // > 0: WGAN-GP's gradient penalty on D (Gulrajani et al., 2017): this weight times the mean over the batch of
  // (|d D(x) / d x| - 1)^2 at random interpolates x = e real + (1 - e) fake (e uniform per image), added to D's loss
  // on the fakes; the penalty's D pass also updates BatchNorm's running statistics, as any D forward does (WGAN-GP
  // critics usually have none). Second derivatives as for R1; eager steps on one stream (graph_fallback() says so).
  double gradient_penalty = 0.0;
  // Steps whose losses wait on the device before step() reads them back itself (a sync).
  int64_t loss_log_steps = 50;
  // Synchronized BatchNorm (--sync-bn; off by default, as in seed 000): the BatchNorm layers of
  // hierpar's models (both layer sets) normalise with the statistics of the whole global batch, summed
  // over the replicas through the averager (strategy/sync_batch_norm.h); no effect with one replica.
  bool sync_batch_norm = false;
  // G's forward and D's pass over the fakes on a second stream of the device (see the top of this file).
  // Used where one CUDA device runs both networks and no averager hooks into the backward (eager data
  // parallelism averages buckets as gradients become ready, on the stream that finished them).
  bool overlap_passes = true;
  // With overlap_passes, captured steps run D's two backward branches as one call from this batch per replica
  // (kJointDiscriminatorBackwardBatch above; a batch size A/B: the bench's HIERPAR_BENCH_JOINT_FROM).
  int64_t joint_discriminator_backward_batch = kJointDiscriminatorBackwardBatch;
  // With overlap_passes, eager steps use the second stream from this batch per replica (kEagerOverlapBatch above;
  // the bench's HIERPAR_BENCH_EAGER_OVERLAP_FROM). Captured steps, and a graph's eager warm-up steps, always do.
  int64_t eager_overlap_batch = kEagerOverlapBatch;
  Schedule schedule = Schedule::exact;
  // A failing replica's own error is printed on stderr when it happens (TORCH_WARN), before step() rethrows
  // it: a collective library may end the process first. Off for a caller that reports failures itself.
  bool report_failures = true;
  // A testing aid: called in each local replica's thread at the start of each step, with the replica's
  // global index and the step's index (0 for this trainer's first); throwing or blocking there is how the
  // tests and hierpar-dcgan's --inject-fault make one replica fail or hang, whatever the step runs
  // (eager or CUDA graphs).
  std::function<void(int64_t replica, int64_t step)> fault_hook;
};

// Converts the 4-d parameters of `module` (and its submodules) to channels_last, in place (set_data).
void convert_to_channels_last(torch::nn::Module& module);

// The losses of one step: one 0-dim tensor per local replica, on its D device (reading them syncs). Under
// CUDA graphs they are the graph's outputs, overwritten by the next step: copy what must be kept.
struct StepLosses {
  std::vector<torch::Tensor> discriminator;       // loss on real + loss on fake
  std::vector<torch::Tensor> discriminator_real;  // its two terms, for logs
  std::vector<torch::Tensor> discriminator_fake;
  std::vector<torch::Tensor> generator;
  // Means over this process's replicas, read on the host (a device sync: call it every N steps).
  std::pair<double, double> mean() const;
};

// One piece of a replica's step as its device's stream ran it (AdversarialTrainer::record_timeline).
struct TimelineSpan {
  int64_t step = 0;     // the trainer's step count when it ran (0-based)
  int64_t replica = 0;  // global replica index
  c10::Device device = c10::Device(c10::kCUDA, 0);
  std::string piece;  // e.g. "G forward", "D real", "copy fakes", "average D"; captured segments join their pieces' names with " + "
  bool compute = false;  // one network's work (an eager piece or a captured segment), not a copy or an averaging
  double start_ms = 0, end_ms = 0;  // from the moment record_timeline(true) was called (devices aligned then)
};

class AdversarialTrainer {
 public:
  // `generator` and `discriminator` become local replica 0 (moved to its devices); replicas 1.. are
  // clone()s (so modules must be torch::nn::Cloneable when a process runs more than one replica).
  // Every replica starts from global replica 0's parameters and buffers (broadcast across processes).
  AdversarialTrainer(torch::nn::AnyModule generator, torch::nn::AnyModule discriminator, Placement placement,
                     AdversarialOptions options = {});
  ~AdversarialTrainer();
  AdversarialTrainer(const AdversarialTrainer&) = delete;
  AdversarialTrainer& operator=(const AdversarialTrainer&) = delete;

  // One step on `real` (this process's share of the global batch, any device; split evenly over the
  // local replicas along dim 0). `noise`, if given, has the same batch size (split the same way);
  // otherwise the noise is drawn as options.noise_shape says. The step's work is queued on the caller's current
  // stream of each device (every replica's thread makes them current), after what the caller queued there, and
  // step() returns without waiting for the GPUs: a batch in pinned host memory is copied asynchronously, so refill
  // such a buffer only after a synchronisation (or hand each step a new one, as the examples' loader does).
  // Throws, naming the replica, if any fails:
  // a PeerFailure when the replicas only waited for a failed, dead or hung peer in another process. A
  // replica that does not return within seconds after its peers stopped is named as hung. A failed step
  // may have updated some replicas and not others, so the trainer then refuses every later step (and
  // broadcast) with the original cause: build a new one, e.g. from the last checkpoint.
  StepLosses step(const torch::Tensor& real, const torch::Tensor& noise = {});
  // The same with each local replica's share given by the caller (reals[i] for local replica i, ideally
  // already on its D device, so that no share crosses devices inside the step); `noises` empty or one
  // per replica.
  StepLosses step_shares(const std::vector<torch::Tensor>& reals, const std::vector<torch::Tensor>& noises = {});

  // The losses of the steps since the last call, as float [steps, 3] on the CPU: columns D loss on real,
  // D loss on fake, G loss, each the mean over this process's replicas. One host sync.
  torch::Tensor take_losses();

  // Whether steps run as CUDA graphs, and if options.cuda_graphs was asked for but cannot be used
  // (synchronized BatchNorm over several replicas), why (one line; empty otherwise).
  bool graphs() const { return graphs_; }
  const std::string& graph_fallback() const { return graph_fallback_; }
  // Kernel nodes of local replica `local`'s captured graphs (0 before the capture).
  int64_t graph_kernel_nodes(int64_t local = 0) const;
  // Under CUDA graphs, the device buffer local replica `local`'s graphs read the real batch from (defined from
  // the first step on, undefined without graphs). Each step copies its batch there, unless the batch already
  // is that buffer (same memory, sizes and strides): a loader that writes batches straight into it saves the
  // copy and a batch's worth of device memory. Write it on the stream the steps run on (the caller's current
  // stream), after step() returns: the queued replay reads it until then.
  torch::Tensor graph_input(int64_t local = 0) const;

  // From record_timeline(true) on, every piece of every step on a CUDA device runs between two timing events on
  // its device's stream: when the stream started and finished it, cross-device waits enqueued in the piece (the
  // copies') included. timeline() waits for the devices and returns the spans recorded since the last call. For
  // traces and idle fractions (hierpar-bench strategy); it costs two events per piece.
  void record_timeline(bool on);
  std::vector<TimelineSpan> timeline();

  // Makes every replica (here and in other processes) equal to global replica 0: parameters and
  // buffers of both networks. Call after loading a checkpoint into local replica 0 of rank 0.
  void broadcast_from_replica0();

  // A split placement: D's process of each replica sends its discriminator's parameters, buffers and optimiser state
  // to G's process, which loads them into `discriminator` and `optimizer` (the same architecture and parameters, on
  // any device): what rank 0, G's process, needs to checkpoint both networks. Both processes of every replica call it
  // at the same point of the run; D's ignores the arguments (null allowed). Without a split placement: nothing.
  void copy_discriminator_to_generator_process(torch::nn::Module* discriminator, torch::optim::Optimizer* optimizer);

  // From any thread (a RunGuard's watchdog): the run failed elsewhere. The averager is aborted (waits for
  // peers end, NCCL communicators are aborted), a step in progress ends with a PeerFailure naming `reason`
  // within seconds, and the trainer refuses every later step. Never blocks.
  void abort(const std::string& reason);
  // Collectives this process's replicas have entered (GradientAverager::progress) and captured steps with
  // collectives they have replayed; 0 with one replica in all. Every rank's count grows alike per step.
  int64_t progress() const;
  // How much of the averaging captured steps capture (GradientAverager::graph_averaging; between without graphs).
  GraphAveraging graph_averaging() const { return graph_averaging_; }

  const Placement& placement() const { return placement_; }
  // Local replica `local`'s modules and optimisers (replica 0's are what a checkpoint saves; with
  // fused_adam the optimisers are FusedAdam, which saves and loads torch::optim::Adam's format). Under
  // CUDA graphs, state loaded after the first step must be copied into the existing tensors. A learning rate set
  // on an optimiser's parameter group (a schedule) applies from the next step, captured steps included.
  torch::nn::AnyModule& generator(int64_t local = 0);
  torch::nn::AnyModule& discriminator(int64_t local = 0);
  torch::optim::Adam& generator_optimizer(int64_t local = 0);
  torch::optim::Adam& discriminator_optimizer(int64_t local = 0);
  // With options.generator_ema_decay > 0: local replica `local`'s moving average of G's parameters, one tensor per
  // parameter in parameters() order, updated in place by each step (copy a loaded state into them); else empty.
  const std::vector<torch::Tensor>& generator_ema(int64_t local = 0) const;

 private:
  struct Replica;
  struct ProgramPiece;
  class Workers;
  enum class Phase { eager, capture };
  // Runs `work` (a piece of local replica `local`'s step on `device`) between timing events when the timeline is on.
  void timed(int64_t local, const c10::Device& device, const std::string& piece, bool compute,
             const std::function<void()>& work);
  StepLosses run_step(const std::vector<torch::Tensor>& reals, const std::vector<torch::Tensor>& noises);
  void step_replica(int64_t local, const torch::Tensor& real, const torch::Tensor& noise, StepLosses& out);
  void graph_step_replica(int64_t local, const torch::Tensor& real, const torch::Tensor& noise);
  // The step's work on local replica `local` (both networks' passes, updates, loss bookkeeping); at each
  // averaging point it averages (eager) or ends a graph segment (capture).
  void step_body(int64_t local, const torch::Tensor& real, const torch::Tensor& noise, Phase phase);
  torch::Tensor global_noise(int64_t share, const c10::Device& device) const;  // [share * global replicas, ...]
  torch::Tensor draw_noise(int64_t local, int64_t share) const;                 // local replica's rows of it
  // The stream for G's forward and D's pass over the fakes of a step with `share` images a replica
  // (options.overlap_passes, options.eager_overlap_batch), or none: one stream.
  std::optional<c10::Stream> fake_pass_stream(int64_t local, int64_t share) const;
  void drain_losses();
  void release_graphs();
  void require_network(Network network) const;  // throws unless this process runs `network` of its replicas
  void refuse_if_failed() const;

  Placement placement_;
  AdversarialOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::unique_ptr<GradientAverager> averager_;
  std::unique_ptr<detail::PartLink> link_;  // a split placement: to the process that runs the replica's other network
  std::unique_ptr<Workers> workers_;
  mutable std::mutex failure_mutex_;
  std::string failure_;   // why an earlier step failed: every later one is refused
  int64_t steps_ = 0;     // steps run (the fault hook's step index)
  bool graphs_ = false;
  GraphAveraging graph_averaging_ = GraphAveraging::between;
  std::atomic<int64_t> replayed_averages_{0};  // progress() of averaging captured in the graphs
  std::string graph_fallback_;
  bool shared_noise_generator_ = false;     // local replicas draw from one generator (CPU)
  int64_t pending_losses_ = 0;              // steps whose losses are still only on the devices
  bool timeline_on_ = false;
  std::vector<std::pair<c10::Device, std::shared_ptr<c10::Event>>> timeline_refs_;  // per device: time zero
  std::vector<torch::Tensor> drained_losses_;  // read back by step() itself, not yet taken
};

}  // namespace hierpar::strategy
