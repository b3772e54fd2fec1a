// hierpar-dcgan tune and train --batch-size auto: the batch-size search of seed 004 on the DCGAN (examples/common/
// batch_tuning.cpp); the search's logic alone is test_batch_size_search.cpp.
#include "examples_testing.h"

using namespace hierpar::examples_testing;

// The DCGAN probe trains its own networks: it measures positive times and, on the CPU, no utilisation or memory.
TEST(Examples, TuneProbeMeasuresStepsOfFreshNetworks) {
  TempDir dir;
  DCGANTrainConfig config = tiny_training(dir / "run");
  config.device = "cpu";
  const auto trial = hierpar::examples::measure_dcgan_steps(config, 8, 64, 2);
  EXPECT_TRUE(trial.fits);
  EXPECT_EQ(trial.batch, 8);
  EXPECT_GT(trial.step_seconds, 0);
  EXPECT_DOUBLE_EQ(trial.epoch_seconds, 8 * trial.step_seconds);  // 64 images in batches of 8
  EXPECT_NEAR(trial.images_per_second, 8 / trial.step_seconds, 1e-6 * trial.images_per_second);
  EXPECT_FALSE(trial.gpu_usage.has_value());
  EXPECT_EQ(trial.peak_bytes, 0);
  EXPECT_EQ(trial.timed_steps, 2);
  EXPECT_GT(trial.build_seconds, 0);
  EXPECT_GT(trial.setup_seconds, trial.build_seconds);  // the warm-up steps
  EXPECT_GT(trial.trial_seconds, trial.setup_seconds + 2 * trial.step_seconds * 0.99);
  // Steps 0: the warm-up alone, which the tune command runs once before its search.
  const auto warm_up = hierpar::examples::measure_dcgan_steps(config, 8, 64, 0);
  EXPECT_TRUE(warm_up.fits);
  EXPECT_EQ(warm_up.timed_steps, 0);
  EXPECT_EQ(warm_up.step_seconds, 0);
  EXPECT_GT(warm_up.setup_seconds, warm_up.build_seconds);
  // With a time bound that any step passes, a trial times 3 steps of the 50 it may.
  const auto bounded = hierpar::examples::measure_dcgan_steps(config, 8, 64, 50, 1e-9);
  EXPECT_EQ(bounded.timed_steps, 3);
  // With one no step fills, it times the 5 it may.
  const auto capped = hierpar::examples::measure_dcgan_steps(config, 8, 64, 5, 1e9);
  EXPECT_EQ(capped.timed_steps, 5);
}

TEST(Examples, TuneChoosesABatchAndDrawsIt) {
  TempDir dir;
  // (No --channels: the data decides, as for train.)
  const std::string common = "tune --device cpu --data synthetic --limit 64 --image-size 32 --width 0.25 "
                             "--batch-size 8 --steps 2 --out " + dir / "tune";
  // The CPU never runs out of memory: max-memory doubles up to the limit.
  std::string out = dcgan_stdout(common + " --objective max-memory --max-batch 32");
  EXPECT_NE(out.find("chose batch 32: the largest batch tried, 32: the limit 32"), std::string::npos) << out;
  for (const char* batch : {"\n       8   yes", "\n      16   yes", "\n      32   yes"})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;
  int w = 0, h = 0, c = 0;
  EXPECT_EQ(stbi_info((dir / "tune/tune.png").c_str(), &w, &h, &c), 1) << "tune.png is not an image";
  // epoch-time grows 8, 12, 20, 32 (units of 4) and stops at the limit 40; the least epoch time wins.
  out = dcgan_stdout(common + " --objective epoch-time --max-batch 40");
  EXPECT_NE(out.find("chose batch "), std::string::npos) << out;
  EXPECT_NE(out.find("the least epoch time measured"), std::string::npos) << out;
  EXPECT_NE(out.find("this is a speed choice"), std::string::npos) << out;
  for (const char* batch : {"\n       8   yes", "\n      12   yes", "\n      20   yes", "\n      32   yes",
                            "\n      40   yes"})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;

  // The sweep beside the search: evenly spaced batches over the search's range, the choice's distance from their
  // best, and what the search cost against a 20-epoch run.
  out = dcgan_stdout(common + " --objective epoch-time --max-batch 24 --sweep 3");
  EXPECT_NE(out.find("sweep: 3 batches from 8 to 24"), std::string::npos) << out;
  for (const char* batch : {"\n  batch 8: ", "\n  batch 16: ", "\n  batch 24: "})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;
  EXPECT_NE(out.find("% from the sweep's best (batch "), std::string::npos) << out;
  EXPECT_NE(out.find("% of a 20-epoch run at batch "), std::string::npos) << out;
  expect_flag_error(run_dcgan(common + " --sweep -1", dir), "--sweep: expected an integer >= 0, got -1",
                    "negative sweep");

  // On a placement: data over two replicas trains each trial on both, and every batch splits evenly over them
  // (from 6 by units of 4: 6, 10, 18, then the limit 22).
  out = dcgan_stdout(common + " --strategy data --gpus 2 --batch-size 6 --objective epoch-time --max-batch 22");
  EXPECT_NE(out.find("on data: replica 0: G cpu, D cpu | replica 1: G cpu, D cpu"), std::string::npos) << out;
  for (const char* batch : {"\n       6   yes", "\n      10   yes", "\n      18   yes", "\n      22   yes"})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;

  // task (G and D apart) and hierarchical (two such replicas) on CPU devices: each trial trains on the placement, and
  // hierarchical's batches split over its two replicas (6, 10, 18, 22 as data's).
  out = dcgan_stdout(common + " --strategy task --gpus 2 --batch-size 6 --objective epoch-time --max-batch 9");
  EXPECT_NE(out.find("on task: replica 0: G cpu, D cpu;"), std::string::npos) << out;
  for (const char* batch : {"\n       6   yes", "\n       9   yes"})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;
  out = dcgan_stdout(common + " --strategy hierarchical --gpus 4 --batch-size 6 --objective epoch-time --max-batch 22");
  EXPECT_NE(out.find("on hierarchical: replica 0: G cpu, D cpu | replica 1: G cpu, D cpu"), std::string::npos) << out;
  for (const char* batch : {"\n       6   yes", "\n      10   yes", "\n      18   yes", "\n      22   yes"})
    EXPECT_NE(out.find(batch), std::string::npos) << batch << " missing from\n" << out;

  expect_flag_error(run_dcgan(common + " --objective fastest", dir),
                    "--objective: expected max-memory, epoch-time or gpu-usage, got 'fastest'", "unknown objective");
  expect_flag_error(run_dcgan(common + " --strategy data --gpus 2 --batch-size 9", dir),
                    "--batch-size 9 does not split evenly over the 2 replicas", "batch not divisible");
  expect_one_line_error(run_dcgan(common + " --objective gpu-usage", dir), "needs a CUDA device and the driver's NVML",
                        "gpu-usage on the CPU");
  expect_flag_error(run_dcgan(common + " --batch-size auto", dir), "--batch-size: expected an integer >= 1, got 'auto'",
                    "auto is train's");
}

// train --batch-size auto: the epoch-time search first (from the default 64, within the data set), then training at
// the chosen batch, which the checkpoint records.
TEST(Examples, TrainWithAutomaticBatchSize) {
  TempDir dir;
  const std::string train = "train --device cpu --data synthetic --limit 128 --image-size 32 --width 0.25 --epochs 1 "
                            "--samples 4 --out " + dir / "run";
  const std::string out = dcgan_stdout(train + " --batch-size auto");
  const auto chose = out.find("train: --batch-size auto chose ");
  ASSERT_NE(chose, std::string::npos) << out;
  const int64_t batch = std::stoll(out.substr(chose + std::strlen("train: --batch-size auto chose ")));
  EXPECT_GE(batch, 64);
  EXPECT_LE(batch, 128);
  EXPECT_NE(out.find("this is a speed choice"), std::string::npos) << out;
  const auto state = hierpar::examples::read_checkpoint_state(dir / "run/checkpoint.pt");
  EXPECT_EQ(state.config.at("batch_size"), std::to_string(batch));
  expect_flag_error(run_dcgan(train + " --batch-size auto --resume", dir),
                    "--batch-size auto with --resume: give the batch size the run was started with", "auto resume");
}

// On a GPU, in a fresh process (the search is then CUDA's first use): the start is paid apart, every trial reports
// its memory and utilisation, and the search ends on the limit.
TEST(Examples, TuneOnCudaInAFreshProcess) {
  HIERPAR_REQUIRE_CUDA();
  TempDir dir;
  const std::string out = dcgan_stdout("tune --device cuda --data synthetic --limit 64 --image-size 32 --width 0.25 "
                                       "--batch-size 8 --steps 3 --objective max-memory --max-batch 32 --out " +
                                       dir / "tune");
  EXPECT_NE(out.find("\nstart: "), std::string::npos) << out;
  EXPECT_NE(out.find("not counted in the search's cost"), std::string::npos) << out;
  EXPECT_NE(out.find("chose batch 32: the largest batch tried, 32: the limit 32"), std::string::npos) << out;
  EXPECT_NE(out.find("warm-up "), std::string::npos) << out;
  EXPECT_NE(out.find("search: 3 trials in "), std::string::npos) << out;
}

// A trial that runs out of memory says what the allocator was asked for and what it held (PyTorch's message).
TEST(Examples, TuneOutOfMemoryNoteNamesTheRequest) {
  const std::string message =
      "CUDA out of memory. Tried to allocate 58.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 20.1 GiB is "
      "free. Including non-PyTorch memory, this process has 59.0 GiB memory in use. Of the allocated memory 17.25 GiB "
      "is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
      "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.";
  EXPECT_EQ(hierpar::examples::out_of_memory_note(message), "out of memory: asked for 58.00 GiB with 17.25 GiB allocated");
  EXPECT_EQ(hierpar::examples::out_of_memory_note("CUDA out of memory. Tried to allocate 2.50 MiB. GPU 0"),
            "out of memory: asked for 2.50 MiB");
  EXPECT_EQ(hierpar::examples::out_of_memory_note("some other allocator's words"), "out of memory");
}
