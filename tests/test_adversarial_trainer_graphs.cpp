// AdversarialTrainer's CUDA-graph steps against eager steps (same seed, K steps, same parameters and losses) on every
// placement, NCCL's all-reduces captured in them, host averaging's captured copies, the overlap of the two devices'
// passes and a replica that hangs under captured collectives. They need GPUs and skip with a reason without them
// (tolerances: adversarial_trainer_testing.h).
#include "adversarial_trainer_testing.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>

using namespace adversarial_trainer_testing;


namespace {
// Deterministic cuDNN without TF32, for the returned guard's lifetime.
[[nodiscard]] hierpar::testing::CudnnSettings deterministic_cudnn() {
  return hierpar::testing::CudnnSettings(/*deterministic=*/true, /*benchmark=*/false, /*tf32=*/false);
}

// The options of an eager run with FusedAdam, and the same captured as CUDA graphs after 2 eager warm-up steps.
std::pair<hs::AdversarialOptions, hs::AdversarialOptions> eager_and_graph_options() {
  auto eager = base_options();
  eager.fused_adam = true;
  auto graphs = eager;
  graphs.cuda_graphs = true;
  graphs.graph_warmup_steps = 2;
  return {eager, graphs};
}

// `placement` trained on `reals` as graphs and eagerly ends the same (within `tol`); returns the eager run.
TrainedRun expect_graphs_equal_eager(const hs::Placement& placement, const std::vector<torch::Tensor>& reals,
                                     Tolerance tol, const std::string& what) {
  const auto [eager, graphs] = eager_and_graph_options();
  const TrainedRun a = train(placement, graphs, reals, 4, 6);
  const TrainedRun b = train(placement, eager, reals, 4, 6);
  EXPECT_GT(a.graph_nodes, 10) << what;
  expect_moved(a, 4);
  expect_same_run(a, b, tol, what + ": graphs vs eager");
  return b;
}

// The streams other than `device`'s current one that own segments of the caching allocator there (it caches memory
// per stream: work issued on a second stream allocates from that stream's own segments).
std::set<void*> other_streams_owning_memory(c10::DeviceIndex device) {
  const void* current = c10::cuda::getCurrentCUDAStream(device).stream();
  std::set<void*> streams;
  for (const auto& segment : c10::cuda::CUDACachingAllocator::snapshot({0, 0}, false).segments)
    if (segment.device == device && segment.stream != current) streams.insert(segment.stream);
  return streams;
}
}  // namespace

// K steps as graphs (2 eager warm-up steps, a capture, replays) equal K eager steps: parameters, BatchNorm
// statistics and every step's losses; in fp32 and in bf16 autocast with channels_last.
TEST(AdversarialTrainerGraphs, GraphStepsEqualEagerSteps) {
  HIERPAR_REQUIRE_CUDA();
  const auto cudnn = deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const auto reals = batches(9, 16, torch::kCUDA);
  const uint64_t init = hierpar::testing::rng()(), noise = hierpar::testing::rng()();
  for (bool bf16 : {false, true}) {
    auto eager = base_options();
    eager.fused_adam = true;
    eager.loss_log_steps = 4;
    eager.generator_ema_decay = 0.9;  // captured with G's update
    if (bf16) {
      eager.precision = hs::StepPrecision{hs::StepPrecision::Math::bf16, true};
    }
    auto graphs = eager;
    graphs.cuda_graphs = true;
    graphs.graph_warmup_steps = 2;
    // A learning-rate schedule that changes after the capture (step 2) must reach the replayed updates.
    const LrSchedule schedule = [](size_t k) { return k < 5 ? 1e-3 : 2.5e-4; };
    const TrainedRun a = train(placement, graphs, reals, init, noise, {}, schedule);
    const TrainedRun b = train(placement, eager, reals, init, noise, {}, schedule);
    const std::string what = bf16 ? "bf16 + channels_last: graphs vs eager" : "fp32: graphs vs eager";
    EXPECT_GT(a.graph_nodes, 10) << what << ": the step was captured";
    EXPECT_EQ(b.graph_nodes, 0);
    expect_moved(a, init);
    ASSERT_EQ(a.losses.size(0), 9) << what;
    expect_same_run(a, b, bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance, what);
    for (size_t k = 0; k < a.step_means.size(); ++k) {
      EXPECT_NEAR(a.step_means[k].first, b.step_means[k].first, 1e-4) << what << " step " << k;
      EXPECT_NEAR(a.step_means[k].second, b.step_means[k].second, 1e-4) << what << " step " << k;
    }
  }
}

// A batch written straight into graph_input() and stepped on in place trains like a batch the step copies
// there; without graphs there is no such buffer.
TEST(AdversarialTrainerGraphs, GraphInputIsReadInPlace) {
  HIERPAR_REQUIRE_CUDA();
  const auto cudnn = deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const auto reals = batches(6, 16, torch::kCUDA);
  auto options = base_options();
  options.fused_adam = options.cuda_graphs = true;
  options.graph_warmup_steps = 2;
  const TrainedRun copied = train(placement, options, reals, 11, 12);

  torch::manual_seed(11);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
  torch::manual_seed(12);
  torch::cuda::manual_seed_all(12);
  EXPECT_FALSE(trainer.graph_input().defined()) << "no buffer before the first step";
  trainer.step(reals[0]);
  const torch::Tensor input = trainer.graph_input();
  ASSERT_TRUE(input.defined());
  for (size_t k = 1; k < reals.size(); ++k) {
    input.copy_(reals[k]);
    trainer.step(input);
  }
  std::vector<torch::Tensor> state;
  for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
    for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().contiguous().clone());
    for (const auto& b : module->buffers()) state.push_back(b.detach().cpu().clone());
  }
  ASSERT_EQ(state.size(), copied.state.size());
  for (size_t i = 0; i < state.size(); ++i)
    hierpar::testing::expect_close(state[i], copied.state[i], kReorderTolerance, "state tensor " + std::to_string(i));

  options.cuda_graphs = false;
  hs::AdversarialTrainer eager(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                               options);
  eager.step(reals[0]);
  EXPECT_FALSE(eager.graph_input().defined()) << "eager steps read the batch where it is";
}

// G's forward and D's pass over the fakes on a second stream (options.overlap_passes, the default) give the
// numbers of one stream: in fp32 the same kernels on the same data, D's two gradient branches summed in either
// order (a + b == b + a), so bit for bit eagerly and to the graph tolerance as graphs; in bf16 autocast the
// overlapped step casts D's weights per pass (no cast cache shared across streams), so D's gradient sums round
// once more: bf16's tolerance. On the tiny pair at batch 16 and at kJointDiscriminatorBackwardBatch (D's two
// backward branches as two calls and as one), and on the seed's DCGAN with hierpar's layers at batch 64
// (passes long enough for the streams to run side by side, so missing ordering would show).
TEST(AdversarialTrainerGraphs, OverlappedPassesEqualOneStream) {
  HIERPAR_REQUIRE_CUDA();
  const auto cudnn = deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const uint64_t init = hierpar::testing::rng()(), noise = hierpar::testing::rng()();
  // Both ways of running D's two backward branches: apart (small batches) and as one call.
  for (const int64_t batch : {int64_t{16}, hs::kJointDiscriminatorBackwardBatch})
  for (bool bf16 : {false, true}) {
    auto one_stream = base_options();
    one_stream.fused_adam = true;
    one_stream.overlap_passes = false;
    if (bf16) {
      one_stream.precision = hs::StepPrecision{hs::StepPrecision::Math::bf16, true};
    }
    auto overlapped = one_stream;
    overlapped.overlap_passes = true;
    overlapped.eager_overlap_batch = 1;  // the eager steps on two streams too
    auto overlapped_graphs = overlapped;
    overlapped_graphs.cuda_graphs = true;
    overlapped_graphs.graph_warmup_steps = 2;
    const auto reals = batches(6, batch, torch::kCUDA);
    const TrainedRun a = train(placement, one_stream, reals, init, noise);
    const TrainedRun b = train(placement, overlapped, reals, init, noise);
    const TrainedRun c = train(placement, overlapped_graphs, reals, init, noise);
    const std::string what = std::string(bf16 ? "bf16 + channels_last" : "fp32") + ", batch " + std::to_string(batch);
    expect_moved(a, init);
    const Tolerance tol = bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance;
    expect_same_run(b, a, tol, what + ": overlapped eager vs one stream");
    expect_same_run(c, a, tol, what + ": overlapped graphs vs one stream");
    if (!bf16) {
      for (size_t i = 0; i < a.state.size(); ++i)
        EXPECT_TRUE(torch::equal(b.state[i], a.state[i])) << "fp32 eager, state tensor " << i << " not bit for bit";
    }
  }

  // The seed's DCGAN, hierpar's layers, channels_last, batch 64, fp32 (TF32 off) and bf16.
  for (bool bf16 : {false, true}) {
    auto run = [&](bool overlap, bool graphs) {
      hierpar::models::DCGANOptions model;
      model.layers = hierpar::LayerSet::hierpar;
      torch::manual_seed(init);
      hierpar::models::Generator g(model);
      hierpar::models::Discriminator d(model);
      hs::AdversarialOptions options;
      options.noise_shape = {model.nz, 1, 1};
      options.fused_adam = true;
      options.precision.channels_last = true;
      options.overlap_passes = overlap;
      options.eager_overlap_batch = 1;
      options.cuda_graphs = graphs;
      options.graph_warmup_steps = 2;
      if (bf16) options.precision.math = hs::StepPrecision::Math::bf16;
      hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, options);
      torch::manual_seed(noise);
      torch::cuda::manual_seed_all(noise);
      hierpar::testing::rng().seed(noise);
      for (int k = 0; k < 5; ++k) {
        trainer.step(hierpar::testing::random_tensor({64, 3, 64, 64}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA),
                                                     hierpar::testing::Layout::channels_last));
      }
      std::vector<torch::Tensor> state;
      for (auto* module : {trainer.generator().ptr().get(), trainer.discriminator().ptr().get()}) {
        for (const auto& p : module->parameters()) state.push_back(p.detach().cpu().contiguous().clone());
        for (const auto& b : module->buffers()) state.push_back(b.detach().cpu().clone());
      }
      return std::pair{state, trainer.take_losses()};
    };
    const auto [state_a, losses_a] = run(false, false);
    const std::string what = std::string("DCGAN batch 64 ") + (bf16 ? "bf16" : "fp32");
    const Tolerance tol = bf16 ? hierpar::testing::tolerance_for(torch::kBFloat16) : kReorderTolerance;
    for (bool graphs : {false, true}) {
      const auto [state_b, losses_b] = run(true, graphs);
      ASSERT_EQ(state_a.size(), state_b.size());
      for (size_t i = 0; i < state_a.size(); ++i)
        hierpar::testing::expect_close(state_b[i], state_a[i], tol,
                                       what + (graphs ? ", overlapped graphs" : ", overlapped eager") +
                                           " vs one stream: state tensor " + std::to_string(i));
      hierpar::testing::expect_close(losses_b, losses_a, tol, what + ": loss log");
    }
  }
}

// Eager steps below options.eager_overlap_batch stay on one stream: the default eager step at batch 16 allocates on
// no other stream and equals overlap_passes off bit for bit; with the threshold at 16 the passes use a second stream
// (seen in the allocator's segments) and give the same numbers within reordering's tolerance.
TEST(AdversarialTrainerGraphs, EagerStepsBelowTheOverlapBatchRunOnOneStream) {
  HIERPAR_REQUIRE_CUDA();
  const auto cudnn = deterministic_cudnn();
  const auto placement = hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {});
  const uint64_t init = hierpar::testing::rng()(), noise = hierpar::testing::rng()();
  constexpr int64_t kBatch = 16;
  ASSERT_LT(kBatch, hs::kEagerOverlapBatch);
  auto one_stream = base_options();
  one_stream.fused_adam = true;
  one_stream.overlap_passes = false;
  auto by_default = one_stream;
  by_default.overlap_passes = true;
  auto two_streams = by_default;
  two_streams.eager_overlap_batch = kBatch;
  const auto reals = batches(6, kBatch, torch::kCUDA);
  const TrainedRun a = train(placement, one_stream, reals, init, noise);
  expect_moved(a, init);

  c10::cuda::CUDACachingAllocator::emptyCache();
  const std::set<void*> before = other_streams_owning_memory(0);
  const TrainedRun b = train(placement, by_default, reals, init, noise);
  EXPECT_EQ(other_streams_owning_memory(0), before)
      << "the default eager step at batch " << kBatch << " allocated on a second stream";
  ASSERT_EQ(a.state.size(), b.state.size());
  for (size_t i = 0; i < a.state.size(); ++i)
    EXPECT_TRUE(torch::equal(b.state[i], a.state[i])) << "state tensor " << i << ": the default eager step at batch "
                                                      << kBatch << " is not the one-stream step";

  c10::cuda::CUDACachingAllocator::emptyCache();
  const TrainedRun c = train(placement, two_streams, reals, init, noise);
  EXPECT_GT(other_streams_owning_memory(0).size(), before.size())
      << "with eager_overlap_batch " << kBatch << " the passes allocated on no second stream";
  ASSERT_EQ(a.state.size(), c.state.size());
  for (size_t i = 0; i < a.state.size(); ++i)
    hierpar::testing::expect_close(c.state[i], a.state[i], kReorderTolerance,
                                   "two streams vs one at batch 16: state tensor " + std::to_string(i));
}

// Data parallelism over 2 GPUs, host and NCCL averaging, graphs against eager (host averaging runs between three
// graphs per replica; NCCL's bucketed all-reduces are captured in the step's one graph).
TEST(AdversarialTrainerGraphs, DataParallelGraphsEqualEagerHostAndNccl) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto cudnn = deterministic_cudnn();
  // 8 images a replica, and kJointDiscriminatorBackwardBatch (D's two backward branches as one call).
  for (const int64_t per_replica : {int64_t{8}, hs::kJointDiscriminatorBackwardBatch}) {
    const auto reals = batches(6, 2 * per_replica, torch::kCUDA);
    for (const char* reduce : {"host", "nccl"}) {
      expect_graphs_equal_eager(hs::Placement::from_flags("data", 2, reduce, c10::DeviceType::CUDA, {}), reals,
                                kReorderTolerance, std::string("data x2, ") + reduce + " averaging, " +
                                                       std::to_string(per_replica) + " images a replica");
    }
  }
}

// NCCL averaging under CUDA graphs is captured: the buckets' all-reduces are nodes of the backward's graph, so a
// data-parallel step replays as one graph per replica, with no averaging piece of its own between segments. On 2
// and 4 GPUs, with caps that cut the tiny networks into several buckets, the captured step gives the numbers of the
// eager bucketed step and of captured steps that all-reduce one flat buffer between their segments
// (capture_collectives off): bit for bit on 2 GPUs (a + b), within the reorder tolerance on 4 (NCCL may sum four
// values in another order for another buffer size or algorithm). progress() counts the replayed steps.
TEST(AdversarialTrainerGraphs, NcclAveragingIsCapturedInTheStep) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto cudnn = deterministic_cudnn();
  auto [eager, graphs] = eager_and_graph_options();
  for (auto* options : {&eager, &graphs}) {
    options->averaging.first_bucket_cap_bytes = 64;
    options->averaging.bucket_cap_bytes = 512;
  }
  auto between = graphs;
  between.averaging.capture_collectives = false;
  // The bucket hooks with D's backward branches apart (8 images a replica) and as one call.
  for (const int64_t per_replica : {int64_t{8}, hs::kJointDiscriminatorBackwardBatch})
  for (int64_t gpus : {2, 4}) {
    if (gpus > static_cast<int64_t>(torch::cuda::device_count())) {
      std::cout << "data x" << gpus << " skipped: " << torch::cuda::device_count() << " GPUs\n";
      continue;
    }
    const auto reals = batches(6, gpus * per_replica, torch::kCUDA);
    const auto placement = hs::Placement::from_flags("data", gpus, "nccl", c10::DeviceType::CUDA, {});
    const std::string what = "data x" + std::to_string(gpus) + ", " + std::to_string(per_replica) + " a replica, nccl: ";
    const Tolerance tol = gpus == 2 ? Tolerance{0, 0} : kReorderTolerance;
    const TrainedRun captured = train(placement, graphs, reals, 4, 6);
    const TrainedRun eager_run = train(placement, eager, reals, 4, 6);
    const TrainedRun between_run = train(placement, between, reals, 4, 6);
    expect_moved(captured, 4);
    expect_same_run(captured, eager_run, tol, what + "captured all-reduce vs eager buckets");
    expect_same_run(captured, between_run, tol, what + "captured all-reduce vs flat all-reduce between segments");
  }

  // The replayed step: one compute span per replica that holds both averages.
  const auto reals = batches(6, 16, torch::kCUDA);
  torch::manual_seed(4);
  PairNet g(true), d(false);
  const auto placement = hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {});
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d), placement, graphs);
  EXPECT_EQ(trainer.graph_averaging(), hs::GraphAveraging::whole);
  for (int k = 0; k < 4; ++k) trainer.step(reals[k]);
  const int64_t before = trainer.progress();
  trainer.record_timeline(true);
  trainer.step(reals[4]);
  trainer.step(reals[5]);
  const auto spans = trainer.timeline();
  EXPECT_EQ(trainer.progress(), before + 2 * 2) << "two replayed steps of two replicas";
  ASSERT_EQ(spans.size(), 4u) << "one span per replica and step";
  for (const auto& span : spans) {
    EXPECT_TRUE(span.compute) << span.piece;
    EXPECT_NE(span.piece.find("average D"), std::string::npos) << span.piece;
    EXPECT_NE(span.piece.find("average G"), std::string::npos) << span.piece;
  }
  hs::AdversarialTrainer flat(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                              between);
  EXPECT_EQ(flat.graph_averaging(), hs::GraphAveraging::between);
}

// A replica that hangs while the others' captured all-reduces wait for it on the GPU (no host wait to time out) is
// named once the averaging timeout has passed since replica 0 returned from the step, and the communicators are
// aborted, so the step ends within seconds instead of never. The hung replica, released afterwards, leaves by an
// exception (it must not replay against aborted communicators).
TEST(AdversarialTrainerGraphs, HungReplicaUnderCapturedNcclIsNamedAfterTheTimeout) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto reals = batches(6, 16, torch::kCUDA);
  auto options = eager_and_graph_options().second;
  options.averaging.timeout = std::chrono::seconds(2);
  options.report_failures = false;
  auto gate = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto released = std::make_shared<bool>(false);
  options.fault_hook = [gate, released](int64_t replica, int64_t step) {
    if (replica != 1 || step != 4) return;
    std::unique_lock<std::mutex> lock(gate->first);
    gate->second.wait(lock, [&] { return *released; });
    throw std::runtime_error("released after the test");
  };
  torch::manual_seed(4);
  PairNet g(true), d(false);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                 hs::Placement::from_flags("data", 2, "nccl", c10::DeviceType::CUDA, {}), options);
  ASSERT_EQ(trainer.graph_averaging(), hs::GraphAveraging::whole);
  for (int k = 0; k < 4; ++k) trainer.step(reals[k]);  // two eager steps, the capture, a replay
  const auto start = std::chrono::steady_clock::now();
  HIERPAR_EXPECT_THROW_MSG(trainer.step(reals[4]), "replica 1 (G cuda:1, D cuda:1) hangs: it had not returned from "
                                                   "its step 2.0 s after replica 0 did");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(seconds, 1.9) << "named before the timeout";
  EXPECT_LT(seconds, 6.0) << "the 2 s timeout took " << seconds << " s";
  HIERPAR_EXPECT_THROW_MSG(trainer.step(reals[5]), "refuses every later one");
  {
    std::lock_guard<std::mutex> lock(gate->first);
    *released = true;
  }
  gate->second.notify_all();
}

// Host averaging on 2 GPUs: eager steps sum buckets on the replicas' threads during the backward (caps of a few
// hundred bytes cut the networks into several), and give the numbers of one flat buffer per network after the
// backward (caps 0), of captured steps (flat, between the segments) and of captured steps whose bucket copies are
// graph nodes (capture_host_copies) bit for bit: every element is the same sum of the same two values, divided
// alike. Two runs of each kind in one process, as a user's runs follow each other.
TEST(AdversarialTrainerGraphs, BucketedHostAveragingEqualsFlatAndGraphs) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto cudnn = deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  const auto placement = hs::Placement::from_flags("data", 2, "host", c10::DeviceType::CUDA, {});
  auto bucketed = eager_and_graph_options().first;
  bucketed.averaging.first_bucket_cap_bytes = 64;
  bucketed.averaging.bucket_cap_bytes = 512;
  auto flat = bucketed;
  flat.averaging.bucket_cap_bytes = 0;
  const auto graphs = eager_and_graph_options().second;
  auto captured_copies = graphs;
  captured_copies.averaging = bucketed.averaging;
  captured_copies.averaging.capture_host_copies = true;
  for (int round = 0; round < 2; ++round) {
    const std::string what = "data x2, host averaging, round " + std::to_string(round) + ": ";
    const TrainedRun a = train(placement, bucketed, reals, 4, 6);
    const TrainedRun b = train(placement, flat, reals, 4, 6);
    const TrainedRun c = train(placement, graphs, reals, 4, 6);
    const TrainedRun d = train(placement, captured_copies, reals, 4, 6);
    expect_moved(a, 4);
    expect_same_run(a, b, Tolerance{0, 0}, what + "bucketed vs flat");
    expect_same_run(c, b, Tolerance{0, 0}, what + "graphs vs eager flat");
    expect_same_run(d, b, Tolerance{0, 0}, what + "graphs with captured bucket copies vs eager flat");
  }
  torch::manual_seed(4);
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(PairNet(true)), torch::nn::AnyModule(PairNet(false)), placement,
                                 captured_copies);
  EXPECT_EQ(trainer.graph_averaging(), hs::GraphAveraging::copies);
}

// Placements whose step spans two devices are captured per device (G's segments on G's GPU, D's on D's, the copies
// and host averaging between, NCCL's all-reduces inside): task on 2 GPUs and hierarchical on 4 (host and NCCL
// averaging), graphs against eager, and task against single. The same kernels on the same data in the same order:
// bit for bit.
TEST(AdversarialTrainerGraphs, TaskAndHierarchicalGraphsEqualEager) {
  HIERPAR_REQUIRE_TWO_GPUS();
  const auto cudnn = deterministic_cudnn();
  const auto reals = batches(6, 16, torch::kCUDA);
  constexpr Tolerance kExact{0, 0};
  const TrainedRun task_eager =
      expect_graphs_equal_eager(hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CUDA, {}), reals, kExact,
                                "task");
  const TrainedRun single = train(hs::Placement::from_flags("single", 1, "host", c10::DeviceType::CUDA, {}),
                                  eager_and_graph_options().first, reals, 4, 6);
  expect_same_run(task_eager, single, kExact, "task vs single (eager)");
  if (torch::cuda::device_count() < 4) {
    std::cout << "hierarchical rows skipped: " << torch::cuda::device_count() << " GPUs, needs 4\n";
    return;
  }
  for (const char* reduce : {"host", "nccl"}) {
    expect_graphs_equal_eager(hs::Placement::from_flags("hierarchical", 4, reduce, c10::DeviceType::CUDA, {}), reals,
                              kExact, std::string("hierarchical x2, ") + reduce + " averaging");
  }
}

// On a task placement D's device runs D's pass over the next real batch while G's device runs G's backward and
// update of the step before: in every steady-state step of the timeline, "D real" starts before the previous step's
// G update ends. A step that made D's real pass wait for G's update (serialised devices) fails this. The seed's
// DCGAN at batch 256, so that the GPUs' work, not the host's, sets the pace.
TEST(AdversarialTrainerGraphs, TaskStepOverlapsTheDevices) {
  HIERPAR_REQUIRE_TWO_GPUS();
  hierpar::models::DCGANOptions model;
  model.layers = hierpar::LayerSet::hierpar;
  torch::manual_seed(1);
  hierpar::models::Generator g(model);
  hierpar::models::Discriminator d(model);
  auto options = base_options();
  options.noise_shape = {model.nz};
  options.fused_adam = options.cuda_graphs = true;
  hs::AdversarialTrainer trainer(torch::nn::AnyModule(g), torch::nn::AnyModule(d),
                                 hs::Placement::from_flags("task", 2, "host", c10::DeviceType::CUDA, {}), options);
  const torch::Tensor real = hierpar::testing::random_tensor(
      {256, 3, 64, 64},
      torch::TensorOptions().dtype(torch::kFloat).device(trainer.placement().replicas[0].discriminator));
  for (int i = 0; i < 5; ++i) trainer.step(real);
  trainer.record_timeline(true);
  for (int i = 0; i < 6; ++i) trainer.step(real);
  const auto spans = trainer.timeline();
  auto find = [&](int64_t step, const std::string& piece) -> const hs::TimelineSpan* {
    for (const auto& s : spans) {
      if (s.step == step && s.piece.find(piece) != std::string::npos) return &s;
    }
    return nullptr;
  };
  int checked = 0;
  for (int64_t step = spans.front().step + 1; step <= spans.back().step; ++step) {
    const hs::TimelineSpan* d_real = find(step, "D real");
    const hs::TimelineSpan* g_update = find(step - 1, "G update");
    ASSERT_TRUE(d_real && g_update) << "step " << step << ": no 'D real' or previous 'G update' span";
    EXPECT_NE(d_real->device, g_update->device);
    EXPECT_LT(d_real->start_ms, g_update->end_ms)
        << "step " << step << ": D's real pass started " << d_real->start_ms - g_update->end_ms
        << " ms after G's update of the step before ended (serialised)";
    ++checked;
  }
  EXPECT_GE(checked, 4);
}
