// The hierpar-dcgan program and the examples' shared code around it (examples/common): image and plot output, flags
// and their one-line errors, training, resume and export, the strategy and step flags. Data loading, checkpoints,
// batch-size tuning and the quality metric have their own files (test_examples_*.cpp).
#include "examples_testing.h"

#include <algorithm>
#include <iterator>

namespace {

using namespace hierpar::examples_testing;

// ---- outputs, flags -----------------------------------------------------------------------------------------

TEST(Examples, ImageGridAndLossPlotArePngs) {
  TempDir dir;
  const int64_t n = rand_int(1, 10);
  write_image_grid(torch::rand({n, 3, 16, 16}) * 2 - 1, dir / "sub/grid.png");
  int w = 0, h = 0, c = 0;
  stbi_uc* pixels = stbi_load((dir / "sub/grid.png").c_str(), &w, &h, &c, 0);
  ASSERT_NE(pixels, nullptr);
  stbi_image_free(pixels);
  const int columns = static_cast<int>(std::ceil(std::sqrt(static_cast<double>(n))));
  const int grid_w = columns * 18 + 2, scale = (512 + grid_w - 1) / grid_w;  // enlarged to 512 px or more
  EXPECT_EQ(w, scale * grid_w);
  EXPECT_EQ(h, scale * (static_cast<int>((n + columns - 1) / columns) * 18 + 2));
  EXPECT_GE(w, 512);
  EXPECT_EQ(c, 3);
  write_line_plot({{"loss", {3, 2, 1.5, 1.2}, {255, 0, 0}}}, "step", dir / "plot.png", 300, 200);
  pixels = stbi_load((dir / "plot.png").c_str(), &w, &h, &c, 0);
  ASSERT_NE(pixels, nullptr);
  EXPECT_EQ(w, 300);
  size_t red = 0;
  for (int i = 0; i < w * h; ++i) red += pixels[i * 3] == 255 && pixels[i * 3 + 1] == 0;
  stbi_image_free(pixels);
  EXPECT_GT(red, 100u) << "the curve was drawn";
}

// Axis ticks are round (multiples of 1, 2 or 5 x 10^k), cover the data and start at 0 or above for data that does.
TEST(Examples, PlotTicksAreRoundAndCoverTheData) {
  for (int trial = 0; trial < 200; ++trial) {
    const double scale = std::pow(10.0, rand_int(-4, 4));
    const double lo = (trial % 2 ? 0.0 : -1.0) * rand_int(0, 50) * scale / 10 + rand_int(0, 30) * scale / 10;
    const double hi = lo + rand_int(1, 100) * scale / 10;
    const auto ticks = round_ticks(lo, hi);
    ASSERT_GE(ticks.size(), 2u);
    EXPECT_LE(ticks.size(), 7u) << lo << " .. " << hi;
    EXPECT_LE(ticks.front(), lo + 1e-9 * scale);
    EXPECT_GE(ticks.back(), hi - 1e-9 * scale);
    if (lo >= 0) EXPECT_GE(ticks.front(), -1e-12) << lo << " .. " << hi;
    const double step = ticks[1] - ticks[0];
    const double mantissa = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
    EXPECT_TRUE(std::abs(mantissa - 1) < 1e-6 || std::abs(mantissa - 2) < 1e-6 || std::abs(mantissa - 5) < 1e-6)
        << "step " << step;
    for (size_t i = 1; i < ticks.size(); ++i) EXPECT_NEAR(ticks[i] - ticks[i - 1], step, 1e-9 * step);
  }
  // The loss plot's case: losses between 0.3 and 5.86 get 0, 2, 4, 6, never an axis below 0.
  EXPECT_EQ(round_ticks(0.3, 5.86), (std::vector<double>{0, 2, 4, 6}));
}

TEST(Examples, FlagsGiveOneLineErrors) {
  int64_t batch = 64;
  double lr = 2e-4;
  std::string data = "x";
  auto parse = [&](std::vector<std::string> args) {
    Flags flags("test");
    flags.add("batch-size", &batch, "", 1).add("lr", &lr, "", 0.0).add("data", &data, "");
    std::vector<char*> argv{const_cast<char*>("prog")};
    for (auto& a : args) argv.push_back(a.data());
    flags.parse(static_cast<int>(argv.size()), argv.data(), 1);
  };
  parse({"--batch-size", "8", "--lr=0.001", "--data", "synthetic"});
  EXPECT_EQ(batch, 8);
  EXPECT_EQ(lr, 0.001);
  EXPECT_EQ(data, "synthetic");
  EXPECT_ERROR_MSG(parse({"--batch-size", "0"}), "--batch-size: expected an integer >= 1, got 0");
  EXPECT_ERROR_MSG(parse({"--batch-size", "8x"}), "--batch-size: expected an integer, got '8x'");
  EXPECT_ERROR_MSG(parse({"--lr", "-1"}), "--lr: expected a number > 0, got -1");
  EXPECT_ERROR_MSG(parse({"--colour", "red"}), "unknown flag --colour for 'test'");
  EXPECT_ERROR_MSG(parse({"--data"}), "--data: missing value");
}

// A help text that states its default is not followed by "(default ...)" too; the others get it once.
TEST(Examples, UsageShowsEachDefaultOnce) {
  int64_t gpus = 0;
  std::string graphs = "auto", data = "fashion-mnist";
  Flags flags("test");
  flags.add("gpus", &gpus, "devices (0: the strategy's own count)", 0)
      .add("graphs", &graphs, "on or off (default: on for CUDA)")
      .add("data", &data, "what to train on");
  const std::string usage = flags.usage();
  EXPECT_NE(usage.find("devices (0: the strategy's own count) (default 0)\n"), std::string::npos) << usage;
  EXPECT_NE(usage.find("on or off (default: on for CUDA)\n"), std::string::npos) << usage;
  EXPECT_EQ(usage.find("(default auto)"), std::string::npos) << usage;
  EXPECT_NE(usage.find("what to train on (default fashion-mnist)\n"), std::string::npos) << usage;
  const std::string help = dcgan_stdout("train --help");
  ASSERT_NE(help.find("--keep-checkpoints"), std::string::npos) << help;
  std::istringstream lines(help);
  for (std::string line; std::getline(lines, line);) {
    const auto first = line.find("default");
    EXPECT_TRUE(first == std::string::npos || line.find("default", first + 1) == std::string::npos) << line;
  }
}

// After a resume the rates count the steps of this run, not those the checkpoint had done.
TEST(Examples, ProgressRatesCountOnlyThisRunsSteps) {
  std::ostringstream captured;
  auto* old = std::cerr.rdbuf(captured.rdbuf());
  const auto start = std::chrono::steady_clock::now();
  {
    Progress progress("epoch 1/1", 100, 1, 0.0, /*first_step=*/90);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    progress.update(100, {});
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cerr.rdbuf(old);
  const std::string line = captured.str();
  const auto at = line.find("100/100  ");
  ASSERT_NE(at, std::string::npos) << line;
  const double rate = std::stod(line.substr(at + 9));
  // 10 steps in 0.2 s at most: at most 50 steps/s, and at least 10 steps over the whole measured time.
  EXPECT_LE(rate, 10 / 0.2 + 0.01) << line;
  EXPECT_GE(rate, 10 / elapsed - 0.01) << line;
}

// ---- training, checkpoints, resume, export -----------------------------------------------------------------------

// How many of `module`'s parameters differ from `other`'s of the same name; expects each of them finite.
int finite_parameters_differing(const torch::nn::Module& module, const torch::nn::Module& other) {
  const auto others = other.named_parameters();
  int differ = 0;
  for (const auto& p : module.named_parameters()) {
    EXPECT_TRUE(torch::isfinite(p.value()).all().item<bool>()) << p.key();
    differ += !p.value().equal(others[p.key()]);
  }
  return differ;
}

TEST(Examples, TrainingStepsOnRealDataChangeTheWeights) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "needs Fashion-MNIST (Debian's dataset-fashion-mnist)";
  TempDir dir;
  auto config = tiny_training(dir.path.string());
  config.max_steps = 3;
  ASSERT_EQ(train_dcgan(config), 0);
  torch::manual_seed(static_cast<uint64_t>(config.seed));
  hierpar::models::Generator initial(config.model);  // the same draws as train_dcgan's
  auto trained = trained_generator(dir / "checkpoint.pt");
  EXPECT_EQ(finite_parameters_differing(*trained, *initial), static_cast<int>(initial->parameters().size()))
      << "every generator parameter should have moved";
  EXPECT_TRUE(fs::exists(dir / "samples/step_000003.png"));
  EXPECT_TRUE(fs::exists(dir / "loss.png"));
  std::ifstream csv(dir / "losses.csv");
  std::string line;
  int lines = 0;
  while (std::getline(csv, line)) ++lines;
  EXPECT_EQ(lines, 1 + 3) << "header and one row per step";
}

TEST(Examples, InterruptedRunResumesToTheSameWeights) {
  TempDir dir;
  // Uninterrupted: 6 steps (the epoch has 4, so this crosses an epoch boundary).
  auto straight = tiny_training(dir / "straight");
  straight.max_steps = 6;
  ASSERT_EQ(train_dcgan(straight), 0);
  // Interrupted after 3 steps (like Ctrl-C), then resumed to 6.
  auto interrupted = tiny_training(dir / "resumed");
  interrupted.max_steps = 6;
  int polls = 0;
  interrupted.should_stop = [&] { return ++polls == 3; };
  ASSERT_EQ(train_dcgan(interrupted), 130);
  auto state = read_checkpoint_state(dir / "resumed/checkpoint.pt");
  EXPECT_EQ(state.global_step, 3);
  EXPECT_EQ(state.history.size(0), 3);
  // A crash while writing the next checkpoint leaves a partial temporary file; the last one still loads.
  std::ofstream(dir / "resumed/checkpoint.pt.tmp") << "partial write";
  EXPECT_NO_THROW(trained_generator(dir / "resumed/checkpoint.pt"));

  auto resumed = tiny_training(dir / "resumed");
  resumed.max_steps = 6;
  resumed.resume = true;
  ASSERT_EQ(train_dcgan(resumed), 0);
  auto a = trained_generator(dir / "straight/checkpoint.pt"), b = trained_generator(dir / "resumed/checkpoint.pt");
  auto pa = a->named_parameters();
  for (const auto& p : b->named_parameters()) hierpar::testing::expect_close(p.value(), pa[p.key()], "resumed " + p.key());
  auto sa = read_checkpoint_state(dir / "straight/checkpoint.pt"), sb = read_checkpoint_state(dir / "resumed/checkpoint.pt");
  EXPECT_EQ(sb.global_step, 6);
  EXPECT_EQ(sb.epoch, sa.epoch);
  hierpar::testing::expect_close(sb.history, sa.history, "loss history");
}

// --ema: the checkpoint keeps G's moving average, which lags the trained weights by the decay; an interrupted run
// resumes it to the same average as a run straight through; a grid is drawn from it beside G's; `generate --weights
// ema` reads it; resuming it without --ema, or asking a checkpoint without one for it, is refused in one line.
// The BatchNorm running means of `g` computed anew from its own weights: each BatchNorm reset to a cumulative
// average, then 16 batches of 512 noise vectors (a seed of its own) through a copy in training mode.
std::vector<torch::Tensor> own_running_means(hierpar::models::Generator& g, int64_t nz) {
  torch::NoGradGuard no_grad;
  auto copy = std::dynamic_pointer_cast<hierpar::models::GeneratorImpl>(g->clone());
  std::vector<torch::Tensor> means;
  for (const auto& module : copy->modules(false)) {
    if (auto* bn = module->as<torch::nn::BatchNorm2d>()) {
      bn->options.momentum(std::nullopt);
      bn->reset_running_stats();
      means.push_back(bn->running_mean);
    }
  }
  copy->train();
  at::Generator noise = at::make_generator<at::CPUGeneratorImpl>(99);
  for (int i = 0; i < 16; ++i) copy->forward(at::randn({512, nz, 1, 1}, noise, at::TensorOptions()));
  return means;
}

std::vector<torch::Tensor> running_means(hierpar::models::Generator& g) {
  std::vector<torch::Tensor> means;
  for (const auto& module : g->modules(false)) {
    if (auto* bn = module->as<torch::nn::BatchNorm2d>()) means.push_back(bn->running_mean);
  }
  return means;
}

double largest_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double largest = 0;
  for (size_t i = 0; i < a.size(); ++i) largest = std::max(largest, (a[i] - b[i]).abs().max().item<double>());
  return largest;
}

TEST(Examples, MovingAverageOfTheGeneratorIsKeptAndResumed) {
  TempDir dir;
  auto straight = tiny_training(dir / "straight");
  straight.max_steps = 6;
  straight.ema = 0.8;
  ASSERT_EQ(train_dcgan(straight), 0);
  auto live = load_generator(dir / "straight/checkpoint.pt", hierpar::LayerSet::stock, torch::kCPU);
  auto average = load_generator(dir / "straight/checkpoint.pt", hierpar::LayerSet::stock, torch::kCPU, "ema");
  EXPECT_EQ(finite_parameters_differing(*average, *live), static_cast<int>(live->parameters().size()))
      << "the average lags every trained parameter";
  // The average's BatchNorm statistics are those of its own weights (computed before the checkpoint was saved), not
  // the live generator's: near a fresh computation from other noise, further from the live ones.
  const auto own = own_running_means(average, straight.model.nz);
  ASSERT_FALSE(own.empty());
  const double saved_vs_own = largest_difference(running_means(average), own);
  const double live_vs_own = largest_difference(running_means(live), own);
  EXPECT_LT(saved_vs_own, 0.25 * live_vs_own) << "saved " << saved_vs_own << ", live " << live_vs_own;
  EXPECT_TRUE(fs::exists(dir / "straight/samples/ema_epoch_000001.png"));
  EXPECT_TRUE(fs::exists(dir / "straight/samples/epoch_000001.png"));

  auto interrupted = tiny_training(dir / "resumed");
  interrupted.max_steps = 6;
  interrupted.ema = 0.8;
  int polls = 0;
  interrupted.should_stop = [&] { return ++polls == 3; };
  ASSERT_EQ(train_dcgan(interrupted), 130);
  auto without = tiny_training(dir / "resumed");
  without.max_steps = 6;
  without.resume = true;
  EXPECT_ERROR_MSG(train_dcgan(without), "keeps a moving average of G's weights: pass --ema 0.8 to resume it");
  auto resumed = without;
  resumed.ema = 0.8;
  ASSERT_EQ(train_dcgan(resumed), 0);
  auto resumed_average = load_generator(dir / "resumed/checkpoint.pt", hierpar::LayerSet::stock, torch::kCPU, "ema");
  auto straight_average = average->named_parameters();
  for (const auto& p : resumed_average->named_parameters())
    hierpar::testing::expect_close(p.value(), straight_average[p.key()], "resumed average " + p.key());

  const auto out = dcgan_stdout("generate --device cpu --weights ema --count 4 --checkpoint " +
                                (dir / "straight/checkpoint.pt") + " --output " + (dir / "ema.png"));
  EXPECT_TRUE(fs::exists(dir / "ema.png")) << out;
  auto plain = tiny_training(dir / "plain");
  plain.max_steps = 1;
  ASSERT_EQ(train_dcgan(plain), 0);
  expect_one_line_error(run_dcgan("generate --device cpu --weights ema --checkpoint " + (dir / "plain/checkpoint.pt") +
                                      " --output " + (dir / "g.png"), dir),
                        "has no moving average of G's weights: it was trained without --ema", "--weights ema");
  expect_one_line_error(run_dcgan("train --device cpu --data synthetic --ema 1 --out " + (dir / "bad"), dir),
                        "--ema: expected a decay in [0, 1)", "--ema 1", 2);
}

TEST(Examples, CheckpointFromAnotherConfigurationIsRejected) {
  TempDir dir;
  auto config = tiny_training(dir.path.string());
  config.data = "synthetic";
  config.max_steps = 1;
  ASSERT_EQ(train_dcgan(config), 0);
  EXPECT_ERROR_MSG(train_dcgan(config), "checkpoint.pt exists: pass --resume");
  config.resume = true;
  config.model.image_size = 64;
  config.batch_size = 8;
  EXPECT_ERROR_MSG(train_dcgan(config), "is from another configuration (checkpoint vs this run: batch_size 16 vs 8, image_size 32 vs 64)");
}

// A truncated, garbage or foreign file is one short line naming it, from the library and from the program.
TEST(Examples, UnusableOutFolderIsRefusedBeforeTraining) {
  TempDir dir;
  const std::string tiny = "train --device cpu --data synthetic --limit 32 --batch-size 16 --image-size 32 --width 0.25 ";
  expect_one_line_error(run_dcgan(tiny + "--out /proc/hierpar-test-no-such-folder", dir),
                        "--out /proc/hierpar-test-no-such-folder: cannot create this folder", "--out under /proc");
  std::ofstream(dir / "a-file") << "x";
  const auto file = run_dcgan(tiny + "--out " + (dir / "a-file"), dir);
  expect_one_line_error(file, "", "--out is a file");
  ASSERT_EQ(file.stderr_lines.size(), 1u);
  EXPECT_EQ(file.stderr_lines[0], "hierpar-dcgan: error: --out " + (dir / "a-file") +
                                      ": is a file, not a folder (give a folder for the output)");
}

namespace {

// The commands that the usage lists (its lines "  <command>  <what it does>").
std::vector<std::string> usage_commands() {
  std::vector<std::string> names;
  std::istringstream usage(dcgan_stdout("--help"));
  for (std::string line; std::getline(usage, line);) {
    if (line.rfind("  ", 0) != 0 || line.size() < 3 || line[2] == ' ') continue;
    names.push_back(line.substr(2, line.find(' ', 2) - 2));
  }
  return names;
}

}  // namespace

// An unknown flag of a command points to that command's own --help, for every command.
TEST(Examples, UnknownFlagPointsToTheCommandsHelp) {
  TempDir dir;
  ASSERT_EQ(usage_commands(), dcgan_commands());
  for (const std::string& command : dcgan_commands()) {
    const auto r = run_dcgan(command + " --nope", dir);
    EXPECT_EQ(r.status, 2) << command;
    ASSERT_EQ(r.stderr_lines.size(), 1u) << command << ": " << c10::Join("\n", r.stderr_lines);
    EXPECT_EQ(r.stderr_lines[0], "hierpar-dcgan: error: unknown flag --nope for 'hierpar-dcgan " + command +
                                     "' (see hierpar-dcgan " + command + " --help)");
  }
}

// The unknown-command line lists every command of the usage, data-speed included.
TEST(Examples, UnknownCommandListsEveryCommand) {
  TempDir dir;
  const auto r = run_dcgan("frobnicate", dir);
  EXPECT_EQ(r.status, 2);
  ASSERT_EQ(r.stderr_lines.size(), 1u) << c10::Join("\n", r.stderr_lines);
  EXPECT_EQ(r.stderr_lines[0], "hierpar-dcgan: error: unknown command 'frobnicate' (train, generate, evaluate, export, "
                               "plot, tune or data-speed) (see hierpar-dcgan --help)");
  const std::string& line = r.stderr_lines[0];
  const size_t open = line.find("' (") + 3;
  const std::string listed = " " + line.substr(open, line.find(") (see") - open);  // " train, generate, ... data-speed"

  const auto commands = usage_commands();
  ASSERT_FALSE(commands.empty());
  for (const std::string& command : commands)
    EXPECT_NE(listed.find(" " + command), std::string::npos) << command << " is missing from: " << listed;
  const auto missing = run_dcgan("", dir);
  EXPECT_EQ(missing.status, 2);
  ASSERT_EQ(missing.stderr_lines.size(), 1u);
  EXPECT_EQ(missing.stderr_lines[0], "hierpar-dcgan: error: missing command (train, generate, evaluate, export, plot, "
                                     "tune or data-speed) (see hierpar-dcgan --help)");
}

// A run that fails before writing anything removes the --out folders it created, and only those.
TEST(Examples, FailedRunLeavesNoNewOutFolder) {
  TempDir dir;
  const std::string tiny = "train --device cpu --limit 32 --batch-size 16 --image-size 32 --width 0.25 ";
  fs::create_directories(dir.path / "empty");
  expect_one_line_error(run_dcgan(tiny + "--data " + (dir / "empty") + " --out " + (dir / "new/a/b"), dir),
                        "no .png, .jpg or .jpeg images", "bad data");
  EXPECT_FALSE(fs::exists(dir / "new")) << "bad data left the --out folders behind";
  expect_one_line_error(run_dcgan(tiny + "--data synthetic --resume --out " + (dir / "new"), dir),
                        "--resume: no checkpoint at " + (dir / "new/checkpoint.pt"), "nothing to resume");
  EXPECT_FALSE(fs::exists(dir / "new")) << "--resume without a checkpoint left the --out folder behind";
  expect_flag_error(run_dcgan(tiny + "--data synthetic --image-size 48 --out " + (dir / "new"), dir),
                    "--image-size: expected 32, 64 or 128, got 48", "bad flag");
  EXPECT_FALSE(fs::exists(dir / "new")) << "a bad flag left the --out folder behind";
  fs::create_directories(dir.path / "existing");
  expect_one_line_error(run_dcgan(tiny + "--data " + (dir / "empty") + " --out " + (dir / "existing/run"), dir),
                        "no .png, .jpg or .jpeg images", "bad data into an existing parent");
  EXPECT_TRUE(fs::is_directory(dir / "existing")) << "a folder that existed before the run was removed";
  EXPECT_FALSE(fs::exists(dir / "existing/run"));
  expect_one_line_error(run_dcgan(tiny + "--data " + (dir / "empty") + " --out " + (dir / "existing"), dir),
                        "no .png, .jpg or .jpeg images", "bad data into an existing --out");
  EXPECT_TRUE(fs::is_directory(dir / "existing")) << "an --out folder that existed before the run was removed";
}

namespace {

// A single-process CPU run long enough to be stopped by a signal (epochs of many steps, no checkpoints in them).
std::string signalled_training(const std::string& out, const std::string& shape) {
  return "train --device cpu --data synthetic --limit 4096 --batch-size 16 --samples 4 --epochs 100 "
         "--checkpoint-every 0 " + shape + " --out " + out;
}

// Starts `args`, sends `signo` once its steps begin, and checks the exit status and the stop line of one process.
void expect_single_process_stop(int signo, int status, const TempDir& dir) {
  const std::string out = dir / "run", err = dir / "run.err";
  const pid_t pid = start_dcgan(signalled_training(out, "--image-size 32 --width 0.25"), err);
  ASSERT_GT(pid, 0);
  const bool started = wait_for_line(err, "output: ", std::chrono::seconds(120));
  ::kill(pid, signo);
  EXPECT_EQ(wait_for_exit(pid), status) << c10::Join("\n", lines_of_file(err));
  ASSERT_TRUE(started) << c10::Join("\n", lines_of_file(err));
  const auto lines = lines_of_file(err);
  ASSERT_FALSE(lines.empty());
  const std::string head = "hierpar-dcgan: interrupted: stopped after step ";
  const std::string tail = "; saved checkpoint " + out + "/checkpoint.pt (--resume continues)";
  const std::string& last = lines.back();
  ASSERT_EQ(last.rfind(head, 0), 0u) << last;
  ASSERT_GT(last.size(), head.size() + tail.size()) << last;
  const std::string step = last.substr(head.size(), last.size() - head.size() - tail.size());
  EXPECT_EQ(step.find_first_not_of("0123456789"), std::string::npos) << last;
  EXPECT_EQ(last.substr(last.size() - tail.size()), tail) << last;
  for (const auto& line : lines) EXPECT_EQ(line.find("rank"), std::string::npos) << "one process has no ranks: " << line;
  EXPECT_TRUE(fs::exists(out + "/checkpoint.pt"));
}

}  // namespace

// A stopped single-process run names its step and checkpoint, no ranks; SIGTERM exits 128 + 15, SIGINT 128 + 2.
TEST(Examples, SignalStopsASingleProcessRunWithTheShellsStatus) {
  {
    TempDir dir;
    expect_single_process_stop(SIGTERM, 143, dir);
  }
  TempDir dir;
  expect_single_process_stop(SIGINT, 130, dir);
}

// A second Ctrl-C before any checkpoint was written (--checkpoint-every 0, mid-epoch) says that nothing resumes.
TEST(Examples, SecondInterruptWithoutACheckpointSaysSo) {
  TempDir dir;
  const std::string out = dir / "run", err = dir / "run.err";
  // Steps of about a second on the CPU: the second signal comes before the first stop's checkpoint.
  const pid_t pid = start_dcgan(signalled_training(out, "--image-size 64 --width 1"), err);
  ASSERT_GT(pid, 0);
  const bool started = wait_for_line(err, "output: ", std::chrono::seconds(120));
  ::kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_for_exit(pid), 130) << c10::Join("\n", lines_of_file(err));
  ASSERT_TRUE(started) << c10::Join("\n", lines_of_file(err));
  const auto lines = lines_of_file(err);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back(), "hierpar-dcgan: second interrupt: exiting at once (no checkpoint was written: this run "
                          "cannot be resumed)");
  EXPECT_FALSE(fs::exists(out + "/checkpoint.pt"));
}

// --resume of a finished run says so and how to go on, trains nothing and exits 0; more --epochs go on.
TEST(Examples, ResumingAFinishedRunSaysHowToGoOn) {
  TempDir dir;
  const std::string tiny = "train --device cpu --data synthetic --limit 32 --batch-size 16 --image-size 32 --width 0.25 "
                           "--samples 4 --out " + (dir / "out") + " ";
  const auto first = run_dcgan(tiny + "--epochs 1", dir);
  ASSERT_EQ(first.status, 0) << c10::Join("\n", first.stderr_lines);
  const auto again = run_dcgan(tiny + "--epochs 1 --resume", dir);
  EXPECT_EQ(again.status, 0);
  ASSERT_EQ(again.stderr_lines.size(), 1u) << c10::Join("\n", again.stderr_lines);
  EXPECT_EQ(again.stderr_lines[0].rfind("nothing to train: " + (dir / "out/checkpoint.pt") +
                                        " has done 2 steps (1 of --epochs 1 epochs); pass a larger --epochs or "
                                        "--max-steps to train on", 0), 0u) << again.stderr_lines[0];
  const auto more = run_dcgan(tiny + "--epochs 2 --resume", dir);
  EXPECT_EQ(more.status, 0) << c10::Join("\n", more.stderr_lines);
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint.pt").global_step, 4);
}

// --r1, --loss hinge and --loss wgan-gp train (second derivatives through hierpar's layers for the penalties), are
// recorded in the checkpoint, and a resume without them is refused in one line that says what to pass; with them it
// goes on.
TEST(Examples, PenaltiesAndLossesTrainAndResumeOnlyWithThem) {
  TempDir dir;
  struct Variant {
    std::string flags, key, value, refusal;
  };
  for (const Variant& v : {Variant{"--r1 2 --r1-every 2", "r1", "2", "was trained with the R1 penalty: pass --r1 2 --r1-every 2"},
                           Variant{"--loss hinge", "loss", "hinge", "was trained with --loss hinge: pass it"},
                           Variant{"--loss wgan-gp", "loss", "wgan-gp", "was trained with --loss wgan-gp: pass it"}}) {
    const std::string out = dir / ("out-" + v.value);
    const std::string tiny = "train --device cpu --data synthetic --limit 32 --batch-size 16 --image-size 32 "
                             "--width 0.25 --layers hierpar --samples 4 --out " + out + " ";
    const auto first = run_dcgan(tiny + "--epochs 1 " + v.flags, dir);
    ASSERT_EQ(first.status, 0) << v.flags << "\n" << c10::Join("\n", first.stderr_lines);
    EXPECT_EQ(read_checkpoint_state(out + "/checkpoint.pt").config.at(v.key), v.value) << v.flags;
    const auto without = run_dcgan(tiny + "--epochs 2 --resume", dir);
    EXPECT_NE(without.status, 0) << v.flags;
    ASSERT_EQ(without.stderr_lines.size(), 1u) << c10::Join("\n", without.stderr_lines);
    EXPECT_NE(without.stderr_lines[0].find(v.refusal), std::string::npos) << without.stderr_lines[0];
    const auto with = run_dcgan(tiny + "--epochs 2 --resume " + v.flags, dir);
    EXPECT_EQ(with.status, 0) << v.flags << "\n" << c10::Join("\n", with.stderr_lines);
    EXPECT_EQ(read_checkpoint_state(out + "/checkpoint.pt").global_step, 4) << v.flags;
  }
}

TEST(Examples, TorchScriptExportGivesTheSameOutput) {
  TempDir dir;
  hierpar::models::DCGANOptions options;
  options.image_size = 32;
  options.channels = rand_int(0, 1) ? 3 : 1;
  options.width = 0.25;
  hierpar::models::Generator generator(options);
  {  // BatchNorm statistics away from their initial 0 and 1, so that the export must carry them.
    torch::NoGradGuard no_grad;
    for (auto& b : generator->named_buffers())
      if (b.key().find("running") != std::string::npos) b.value().uniform_(0.5, 1.5);
  }
  generator->eval();
  auto z = torch::randn({3, 100});
  auto expected = generator->forward(z);
  auto module = export_generator(*generator);
  module.save(dir / "g.pt");
  auto loaded = torch::jit::load(dir / "g.pt");
  hierpar::testing::expect_close(loaded.forward({z}).toTensor(), expected, "TorchScript output");
  EXPECT_EQ(loaded.named_parameters().size(), generator->parameters().size());

  // The hierpar variant calls torch.ops.hierpar.*: it must compile against the registered schemas, and
  // give the same output wherever the operators have CPU kernels.
  auto hierpar_module = export_generator(*generator, ExportOps::hierpar);
  auto has_cpu_kernel = [](const char* op) {
    auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
    return handle && handle->hasKernelForDispatchKey(c10::DispatchKey::CPU);
  };
  if (!has_cpu_kernel("hierpar::conv_transpose2d") || !has_cpu_kernel("hierpar::batch_norm_act")) {
    GTEST_SKIP() << "the hierpar ops have no CPU kernels in this build: the hierpar export compiled but did not run";
  }
  hierpar_module.save(dir / "gh.pt");
  hierpar::testing::expect_close(torch::jit::load(dir / "gh.pt").forward({z}).toTensor(), expected,
                                 {1e-4, 1e-5}, "TorchScript output with hierpar ops");
}

// ---- the program: bad input gives one line on stderr and a non-zero exit -------------------------------------

TEST(Examples, ProgramReportsBadInputInOneLine) {
  TempDir dir;
  const std::string base = "train --device cpu --out " + (dir / "out") + " ";
  fs::create_directories(dir.path / "mnist");
  expect_one_line_error(run_dcgan(base + "--fashion-mnist-dir " + (dir / "mnist"), dir), "train-images-idx3-ubyte.gz: no such file", "missing data set");
  write_gz(dir / "mnist/train-images-idx3-ubyte.gz", idx_bytes({2, 28, 28}, random_bytes(2 * 28 * 28), 0x09));
  expect_one_line_error(run_dcgan(base + "--fashion-mnist-dir " + (dir / "mnist"), dir), "not an IDX file", "wrong magic");
  std::ofstream(dir / "mnist/train-images-idx3-ubyte.gz", std::ios::trunc) << "\x1f\x8b\x08";
  expect_one_line_error(run_dcgan(base + "--fashion-mnist-dir " + (dir / "mnist"), dir), "truncated", "truncated gzip");
  fs::create_directories(dir.path / "empty");
  expect_one_line_error(run_dcgan(base + "--data " + (dir / "empty"), dir), "no .png, .jpg or .jpeg images", "empty folder");
  fs::create_directories(dir.path / "nested/class_a");
  write_png(dir / "nested/a.png", 4, 4, 1, random_bytes(16));
  std::ofstream(dir / "nested/class_a/b.jpg") << "garbage";
  expect_one_line_error(run_dcgan(base + "--data " + (dir / "nested"), dir), "nested/class_a/b.jpg: cannot read image",
                        "unreadable image in a subfolder");
  fs::create_directories(dir.path / "bad");
  std::ofstream(dir / "bad/a.png") << "garbage";
  expect_one_line_error(run_dcgan(base + "--data " + (dir / "bad"), dir), "a.png: cannot read image", "unreadable image");
  expect_flag_error(run_dcgan(base + "--batch-size 0", dir), "--batch-size: expected an integer >= 1 or auto, got '0'",
                    "batch 0");
  expect_flag_error(run_dcgan(base + "--image-size 48", dir), "--image-size: expected 32, 64 or 128, got 48", "image size");
  expect_flag_error(run_dcgan(base + "--layers fast", dir), "--layers: expected stock or hierpar, got 'fast'", "layer set");
  expect_flag_error(run_dcgan(base + "--memory swap", dir), "--memory: expected none, recompute or offload, got 'swap'",
                    "memory mode");
  expect_flag_error(run_dcgan(base + "--memory offload --offload-budget 2", dir),
                    "--offload-budget: expected a fraction of the GPU's memory in [0, 1], got 2", "offload budget");
  expect_flag_error(run_dcgan(base + "--memory-slices 4", dir),
                    "--memory-slices: slices the backward of recomputed blocks; expected --memory recompute or offload "
                    "with 4 slices, got --memory none", "memory slices without recompute");
  expect_flag_error(run_dcgan(base + "--memory recompute --memory-slices 0", dir), "--memory-slices", "zero slices");
  expect_flag_error(run_dcgan(base + "--memory offload --r1 1", dir),
                    "--memory offload: the R1 and gradient penalties differentiate through every block's input",
                    "offload with a penalty");
  expect_flag_error(run_dcgan(base + "--sync-bn --memory recompute", dir),
                    "--sync-bn with --memory recompute: the backward's recomputation would use one replica's BatchNorm "
                    "statistics; use --memory none", "sync BN with recompute");
  expect_flag_error(run_dcgan(base + "--loss lsgan", dir), "--loss: expected bce, hinge or wgan-gp, got 'lsgan'", "loss");
  expect_flag_error(run_dcgan(base + "--data-placement files", dir),
                    "--data-placement files: needs --data <folder of images>", "files without a folder");
  expect_flag_error(run_dcgan(base + "--beta1 1.5", dir), "--beta1: expected a number in [0, 1), got 1.5", "beta1");
  expect_flag_error(run_dcgan(base + "--keep-checkpoints 0", dir), "--keep-checkpoints: expected an integer >= 1, got 0", "kept checkpoints");
  expect_flag_error(run_dcgan(base + "--data synthetic --memory-snapshot " + (dir / "m.pickle"), dir),
                    "--memory-snapshot: records the CUDA caching allocator; this run has no CUDA device",
                    "memory snapshot on the CPU");
  expect_flag_error(run_dcgan("generate --layers fast", dir), "--layers: expected stock or hierpar, got 'fast'", "generate's layer set");
  expect_flag_error(run_dcgan("tune --device cpu --data synthetic --limit 32 --objective max-memory --memory-resolution 1",
                              dir),
                    "--memory-resolution: expected a fraction in [0, 1), got 1", "tune's memory resolution");
  expect_flag_error(run_dcgan(base + "--epochs", dir), "--epochs: missing value", "missing value");
  expect_flag_error(run_dcgan(base + "--colour red", dir), "unknown flag --colour", "unknown flag");
  expect_flag_error(run_dcgan("frobnicate", dir), "unknown command 'frobnicate'", "unknown command");

  // A checkpoint from another configuration.
  const std::string tiny = base + "--data synthetic --limit 32 --batch-size 16 --image-size 32 --width 0.25 --max-steps 1 ";
  auto ok = run_dcgan(tiny, dir);
  ASSERT_EQ(ok.status, 0) << c10::Join("\n", ok.stderr_lines);
  expect_one_line_error(run_dcgan(tiny + "--resume --width 0.5", dir), "from another configuration (checkpoint vs this run: width 0.25 vs 0.5)", "other configuration");
  expect_one_line_error(run_dcgan("generate --device cpu --checkpoint " + (dir / "nothing.pt"), dir), "nothing.pt: no such checkpoint", "missing checkpoint");
  // The checkpoint serves generate and export.
  auto generated = run_dcgan("generate --device cpu --count 5 --checkpoint " + (dir / "out/checkpoint.pt") + " --output " + (dir / "five.png"), dir);
  EXPECT_EQ(generated.status, 0) << c10::Join("\n", generated.stderr_lines);
  EXPECT_TRUE(fs::exists(dir / "five.png"));
  auto exported = run_dcgan("export --checkpoint " + (dir / "out/checkpoint.pt") + " --output " + (dir / "g.pt"), dir);
  EXPECT_EQ(exported.status, 0) << c10::Join("\n", exported.stderr_lines);
  EXPECT_EQ(torch::jit::load(dir / "g.pt").forward({torch::randn({2, 100})}).toTensor().sizes(),
            (std::vector<int64_t>{2, 3, 32, 32})) << "synthetic data defaults to 3 channels";
}


// ---- the training strategy flags (hierpar::strategy) ----------------------------------------------------------

namespace {

// Flags added to a small synthetic CPU run, the text of the one-line error they give, and what the case checks.
struct BadTrainFlags {
  std::string flags, error, what;
};

// Each case stops `hierpar-dcgan train` with its one-line flag error before a checkpoint is written.
void expect_train_flag_errors(const TempDir& dir, const std::vector<BadTrainFlags>& cases) {
  const std::string base =
      "train --device cpu --data synthetic --limit 32 --image-size 32 --width 0.25 --out " + (dir / "bad") + " ";
  for (const BadTrainFlags& c : cases) expect_flag_error(run_dcgan(base + c.flags, dir), c.error, c.what);
  EXPECT_FALSE(fs::exists(dir / "bad/checkpoint.pt"));
}

}  // namespace

TEST(Examples, StrategyFlagsParseAndValidate) {
  TempDir dir;
  auto config = tiny_training(dir / "out");
  config.strategy = "data";
  config.gpus = 2;
  ASSERT_TRUE(config.reduce.empty()) << "--reduce's default: nccl on GPUs, host on the CPU";
  EXPECT_EQ(dcgan_placement(config).to_string(), "data: replica 0: G cpu, D cpu | replica 1: G cpu, D cpu; reduce=host");
  if (torch::cuda::device_count() >= 2) {
    auto on_gpus = config;
    on_gpus.device = "cuda";
    EXPECT_EQ(dcgan_placement(on_gpus).reduce, hierpar::strategy::Reduce::collective);
  }
  config.strategy = "task";
  config.gpus = 0;  // the scheme's own count
  config.reduce = "nccl";  // Gloo's collectives with --device cpu: how the tests run the collective averaging
  EXPECT_EQ(dcgan_placement(config).to_string(), "task: replica 0: G cpu, D cpu; reduce=nccl");
  config.strategy = "hierarchical";
  EXPECT_EQ(dcgan_placement(config).global_replicas(), 1);
  config.gpus = 4;
  EXPECT_EQ(dcgan_placement(config).global_replicas(), 2);
  // A process per device splits each replica over two processes (G in even ranks, D in odd ones).
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "3", 1);
  EXPECT_EQ(dcgan_placement(config).to_string(),
            "hierarchical: replica 1: D cpu (G on rank 2); reduce=nccl, rank 3 of 4 processes");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("RANK");

}

// Several CPU "devices" are threads standing in for GPUs, for tests: without --device cpu a placement needs GPUs.
TEST(Examples, CpuPlacementsNeedDeviceCpu) {
  TempDir dir;
  auto config = tiny_training(dir / "out");
  config.device = "";  // as given by no --device flag
  for (const auto& [strategy, gpus] : std::vector<std::pair<std::string, int64_t>>{{"hierarchical", 4}, {"data", 2}, {"task", 0}}) {
    config.strategy = strategy;
    config.gpus = gpus;
    if (hierpar::testing::cuda_available()) {
      // With GPUs the same flags place on them (or say how many are missing).
      try {
        EXPECT_TRUE(dcgan_placement(config).replicas[0].generator.is_cuda()) << strategy;
      } catch (const FlagError& e) {
        EXPECT_NE(std::string(e.what()).find("--gpus"), std::string::npos) << e.what();
      }
      continue;
    }
    EXPECT_ERROR_MSG(dcgan_placement(config), "needs CUDA devices and this machine has none; --device cpu runs it on CPU threads");
  }
  if (!hierpar::testing::cuda_available()) {
    expect_flag_error(run_dcgan("train --data synthetic --strategy hierarchical --gpus 4 --out " + (dir / "out"), dir),
                      "--strategy hierarchical --gpus 4 needs CUDA devices and this machine has none", "hierarchical without GPUs");
    EXPECT_FALSE(fs::exists(dir / "out/checkpoint.pt"));
  }
  config.strategy = "single";  // one device: the CPU when there is no GPU, as --device's default says
  config.gpus = 0;
  EXPECT_EQ(dcgan_placement(config).replicas[0].generator.is_cuda(), hierpar::testing::cuda_available());
}

// Two replicas of the program on CPU "devices" (threads, host averaging): the checkpoint (replica 0's
// networks and optimisers) resumes under data to the same weights as a straight run, and under single.
TEST(Examples, DataParallelCpuRunResumesUnderDataAndSingle) {
  TempDir dir;
  const std::string common = "train --device cpu --data synthetic --limit 64 --image-size 32 --width 0.25 --channels 1 "
                             "--batch-size 16 --samples 4 --seed 7 --epochs 2 ";
  const std::string data2 = common + "--strategy data --gpus 2 --reduce host ";
  auto run = [&](const std::string& args, const std::string& what) {
    auto r = run_dcgan(args, dir);
    EXPECT_EQ(r.status, 0) << what << ":\n" << c10::Join("\n", r.stderr_lines);
    return r;
  };
  // 6 steps straight (an epoch has 4: this crosses an epoch boundary), and 3 + 3 with a resume.
  auto straight = run(data2 + "--max-steps 6 --out " + (dir / "straight"), "straight data run");
  EXPECT_NE(c10::Join("\n", straight.stderr_lines).find("strategy: data: replica 0: G cpu, D cpu | replica 1: G cpu, D cpu; reduce=host; global batch 16 = 2 replica(s) x 8"),
            std::string::npos) << c10::Join("\n", straight.stderr_lines);
  run(data2 + "--max-steps 3 --out " + (dir / "resumed"), "first half");
  ASSERT_EQ(read_checkpoint_state(dir / "resumed/checkpoint.pt").global_step, 3);
  fs::create_directories(dir.path / "single");
  fs::copy_file(dir / "resumed/checkpoint.pt", dir / "single/checkpoint.pt");
  run(data2 + "--max-steps 6 --resume --out " + (dir / "resumed"), "resumed data run");
  EXPECT_TRUE(fs::exists(dir / "resumed/samples/epoch_000001.png"));
  EXPECT_TRUE(fs::exists(dir / "resumed/losses.csv"));

  auto a = trained_generator(dir / "straight/checkpoint.pt"), b = trained_generator(dir / "resumed/checkpoint.pt");
  auto pa = a->named_parameters();
  for (const auto& p : b->named_parameters()) hierpar::testing::expect_close(p.value(), pa[p.key()], "resumed data " + p.key());
  auto sa = read_checkpoint_state(dir / "straight/checkpoint.pt"), sb = read_checkpoint_state(dir / "resumed/checkpoint.pt");
  EXPECT_EQ(sb.global_step, 6);
  hierpar::testing::expect_close(sb.history, sa.history, "loss history");

  // The 2-replica checkpoint at step 3 continues on one device.
  auto at3 = trained_generator(dir / "single/checkpoint.pt");
  run(common + "--strategy single --max-steps 5 --resume --out " + (dir / "single"), "resumed under single");
  const auto s = read_checkpoint_state(dir / "single/checkpoint.pt");
  EXPECT_EQ(s.global_step, 5);
  EXPECT_EQ(s.history.size(0), 5);
  auto p3 = at3->named_parameters();
  int moved = 0;
  for (const auto& p : trained_generator(dir / "single/checkpoint.pt")->named_parameters()) {
    EXPECT_TRUE(torch::isfinite(p.value()).all().item<bool>()) << p.key();
    moved += !p.value().equal(p3[p.key()]);
  }
  EXPECT_EQ(moved, static_cast<int>(p3.size())) << "every generator parameter should move in the 2 single steps";
}

// 4 steps of a small DCGAN on the CPU with `args`, into <dir>/<out>: the losses of every step (the checkpoint's
// history) and what the run said on stderr.
std::pair<torch::Tensor, std::string> four_cpu_steps(const TempDir& dir, const std::string& args, const std::string& out) {
  const std::string common = "train --device cpu --data synthetic --limit 32 --image-size 32 --width 0.25 --channels 1 "
                             "--batch-size 16 --samples 4 --seed 11 --epochs 2 --max-steps 4 ";
  auto r = run_dcgan(common + args + " --out " + (dir / out), dir);
  EXPECT_EQ(r.status, 0) << args << ":\n" << c10::Join("\n", r.stderr_lines);
  return {read_checkpoint_state(dir / (out + "/checkpoint.pt")).history, c10::Join("\n", r.stderr_lines)};
}

// --sync-bn reaches the trainer: 2 data-parallel replicas with BatchNorm statistics over both halves train like
// one device on the whole batch (without it they differ: each half normalises by itself). Compared through the
// losses of every step (each evaluates the networks the previous updates left): Adam divides each gradient
// element by its own size, so single weights whose terms cancel may move by a visible part of lr from fp32
// summation order alone, while the losses stay within a few float roundings.
TEST(Examples, SyncBatchNormDataRunMatchesSingle) {
  TempDir dir;
  auto run = [&](const std::string& args, const std::string& out) { return four_cpu_steps(dir, args, out).first; };
  const auto single = run("--strategy single", "single");
  const auto synced = run("--strategy data --gpus 2 --reduce host --sync-bn", "synced");
  const auto per_replica = run("--strategy data --gpus 2 --reduce host", "per_replica");
  ASSERT_EQ(single.size(0), 4);
  hierpar::testing::expect_close(synced, single, {1e-4, 1e-5}, "sync-bn data losses vs single");
  EXPECT_GT((per_replica - single).abs().max().item<double>(), 1e-3)
      << "per-replica BatchNorm should give other losses than the whole batch";
}

// --memory recompute and offload with each block's backward in slices train as keeping the activations: the
// losses of every step within a few float roundings (the slices sum BatchNorm's terms and the weight gradients in
// another order), and the run says how it keeps its activations.
TEST(Examples, MemorySlicesTrainAsKeepingTheActivations) {
  TempDir dir;
  const auto kept = four_cpu_steps(dir, "--memory none", "none");
  for (const char* memory : {"recompute", "offload"}) {
    const auto [losses, said] = four_cpu_steps(dir, std::string("--memory ") + memory + " --memory-slices 3", memory);
    EXPECT_NE(said.find("each block's backward in 3 slices of the batch"), std::string::npos) << said;
    ASSERT_EQ(losses.size(0), 4);
    hierpar::testing::expect_close(losses, kept.first, {1e-4, 1e-5}, std::string(memory) + " in 3 slices: losses");
  }
}

}  // namespace

// ---- the training step's flags (issue 7): graphs, precision, layout, optimiser, loss reading ---------------

namespace {

// Generator and discriminator parameters and buffers of a checkpoint, on the CPU.
std::vector<torch::Tensor> checkpoint_networks(const std::string& path, const hierpar::models::DCGANOptions& options) {
  hierpar::models::Generator g(options);
  hierpar::models::Discriminator d(options);
  load_checkpoint(path, {}, {{"generator", g.get()}, {"discriminator", d.get()}}, {}, torch::kCPU, /*restore_rng=*/false);
  std::vector<torch::Tensor> out;
  for (auto* m : {static_cast<torch::nn::Module*>(g.get()), static_cast<torch::nn::Module*>(d.get())}) {
    for (const auto& p : m->parameters()) out.push_back(p.detach().contiguous());
    for (const auto& b : m->buffers()) out.push_back(b.detach());
  }
  return out;
}

}  // namespace

// Each bad placement or step flag stops `hierpar-dcgan train` with its one-line error before a checkpoint is written.
TEST(Examples, BadTrainFlagsGiveOneLineErrors) {
  TempDir dir;
  expect_train_flag_errors(
      dir, {{"--strategy model", "--strategy: expected single, task, data or hierarchical, got 'model'", "strategy"},
            {"--reduce mpi", "--reduce: expected host or nccl, got 'mpi'", "reduce name"},
            {"--strategy hierarchical --gpus 3", "needs an even --gpus", "odd hierarchical"},
            {"--strategy task --gpus 3", "uses exactly 2 devices", "task on 3"},
            {"--strategy single --gpus 2", "uses exactly 1 device", "single on 2"},
            {"--gpus -1", "--gpus: expected an integer >= 0, got -1", "negative gpus"},
            {"--strategy data --gpus 4 --batch-size 18", "--batch-size 18 does not split evenly over the 4 replicas",
             "uneven split"},
            {"--graphs sometimes", "--graphs: expected on or off, got 'sometimes'", "graphs value"},
            {"--precision fp16", "--precision: expected fp32, tf32 or bf16, got 'fp16'", "precision value"},
            {"--overlap maybe", "--overlap: expected on or off, got 'maybe'", "overlap value"},
            {"--optimizer sgd", "--optimizer: expected adam or fused, got 'sgd'", "optimizer value"},
            {"--graphs on", "--graphs on needs a CUDA device (this run is on the CPU)", "graphs on CPU"},
            {"--precision bf16", "--precision bf16 needs a CUDA device", "bf16 on CPU"},
            {"--log-every 0", "--log-every: expected an integer >= 1, got 0", "log interval"},
            {"--channels-last=yes", "--channels-last takes no value", "boolean flag"},
            {"--schedule ahead", "--schedule must be exact or pipelined; got \"ahead\"", "schedule name"}});
}

TEST(Examples, PlotFlagsGiveOneLineErrors) {
  TempDir dir;
  expect_flag_error(run_dcgan("plot --output " + (dir / "p.png"), dir), "--runs: give at least one LABEL=PATH", "no runs");
  expect_flag_error(run_dcgan("plot --runs nolabel --output " + (dir / "p.png"), dir), "--runs: expected LABEL=PATH, got 'nolabel'", "run without label");
  expect_one_line_error(run_dcgan("plot --runs a=" + (dir / "none.csv") + " --output " + (dir / "p.png"), dir), "none.csv: cannot read the losses", "missing csv");
  std::ofstream(dir / "junk.csv") << "a,b\n1,2\n";
  expect_one_line_error(run_dcgan("plot --runs a=" + (dir / "junk.csv") + " --output " + (dir / "p.png"), dir), "junk.csv: not a hierpar-dcgan losses.csv", "wrong csv");
}

// --schedule pipelined trains (finite losses, a checkpoint) to other weights than the exact schedule from the same
// seed: the flag reaches the trainer.
TEST(Examples, PipelinedScheduleTrainsToOtherWeights) {
  TempDir dir;
  auto exact = tiny_training(dir / "exact");
  exact.max_steps = 4;
  ASSERT_EQ(train_dcgan(exact), 0);
  auto pipelined = exact;
  pipelined.out = dir / "pipelined";
  pipelined.schedule = "pipelined";
  ASSERT_EQ(train_dcgan(pipelined), 0);
  const auto a = checkpoint_networks(dir / "exact/checkpoint.pt", exact.model);
  const auto b = checkpoint_networks(dir / "pipelined/checkpoint.pt", exact.model);
  ASSERT_EQ(a.size(), b.size());
  double largest = 0;
  for (size_t i = 0; i < a.size(); ++i) largest = std::max(largest, (a[i] - b[i]).abs().max().item<double>());
  EXPECT_GT(largest, 1e-6);
  const auto history = read_checkpoint_state(dir / "pipelined/checkpoint.pt").history;
  ASSERT_EQ(history.size(0), 4);
  EXPECT_TRUE(history.isfinite().all().item<bool>());
}

// On the CPU: FusedAdam + channels_last + losses read every 3 steps train, interrupt and resume to the same
// weights as a straight run (FusedAdam's state goes through the checkpoint), and the plot command draws
// two runs' curves.
TEST(Examples, FusedChannelsLastRunResumesAndPlots) {
  TempDir dir;
  auto straight = tiny_training(dir / "straight");
  straight.optimizer = "fused";
  straight.channels_last = true;
  straight.log_every = 3;
  straight.max_steps = 6;
  ASSERT_EQ(train_dcgan(straight), 0);
  auto interrupted = straight;
  interrupted.out = dir / "resumed";
  int polls = 0;
  interrupted.should_stop = [&] { return ++polls == 4; };
  ASSERT_EQ(train_dcgan(interrupted), 130);
  auto resumed = straight;
  resumed.out = dir / "resumed";
  resumed.resume = true;
  ASSERT_EQ(train_dcgan(resumed), 0);
  const auto a = checkpoint_networks(dir / "straight/checkpoint.pt", straight.model);
  const auto b = checkpoint_networks(dir / "resumed/checkpoint.pt", straight.model);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) hierpar::testing::expect_close(b[i], a[i], "resumed (FusedAdam) tensor " + std::to_string(i));
  const auto sa = read_checkpoint_state(dir / "straight/checkpoint.pt"), sb = read_checkpoint_state(dir / "resumed/checkpoint.pt");
  ASSERT_EQ(sa.history.size(0), 6) << "one row per step although read every 3";
  hierpar::testing::expect_close(sb.history, sa.history, "loss history");

  auto adam = tiny_training(dir / "adam");
  adam.max_steps = 6;
  ASSERT_EQ(train_dcgan(adam), 0);
  const auto lines = plot_loss_runs({{"fused", dir / "straight/losses.csv"}, {"adam", dir / "adam/losses.csv"}}, dir / "curves.png");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].rfind("fused: 6 steps; mean over steps 5-6: D loss ", 0), 0u) << lines[0];
  int w = 0, h = 0, c = 0;
  stbi_uc* pixels = stbi_load((dir / "curves.png").c_str(), &w, &h, &c, 0);
  ASSERT_NE(pixels, nullptr);
  stbi_image_free(pixels);
  EXPECT_EQ(w, 900);
}

// On a GPU: --memory-snapshot writes the allocator's history as a pickle after the first steps (and, for a shorter
// run, at its end), says where, and the run trains on.
TEST(Examples, MemorySnapshotIsWrittenOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  TempDir dir;
  const std::string tiny = "train --device cuda --data synthetic --limit 64 --batch-size 16 --image-size 32 --width 0.25 ";
  for (const int steps : {8, 2}) {
    const std::string file = dir / ("steps" + std::to_string(steps) + ".pickle");
    const auto run = run_dcgan(tiny + "--max-steps " + std::to_string(steps) + " --memory-snapshot " + file + " --out " +
                                   (dir / ("out" + std::to_string(steps))), dir);
    ASSERT_EQ(run.status, 0) << c10::Join("\n", run.stderr_lines);
    const std::string said = steps > 5 ? "memory snapshot of steps 1-5: " + file : "memory snapshot of the run's steps: " + file;
    EXPECT_TRUE(std::any_of(run.stderr_lines.begin(), run.stderr_lines.end(),
                            [&](const std::string& line) { return line.rfind(said, 0) == 0; }))
        << said << " not in:\n" << c10::Join("\n", run.stderr_lines);
    std::ifstream in(file, std::ios::binary);
    ASSERT_TRUE(in.good()) << file;
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(bytes.size(), 1000u) << file;
    EXPECT_EQ(static_cast<unsigned char>(bytes[0]), 0x80) << "a pickle starts with its protocol";
    EXPECT_NE(bytes.find("device_traces"), std::string::npos) << "the allocations' history";
    EXPECT_NE(bytes.find("segments"), std::string::npos);
    EXPECT_FALSE(fs::exists(file + ".tmp"));
  }
}

// On a GPU: the same seed and K steps with --graphs on and --graphs off end with the same networks and
// losses (fp32 with deterministic cuDNN: the graph replays run the eager steps' kernels; bf16 autocast +
// channels_last to bf16's tolerance), with hierpar's layers and FusedAdam.
TEST(Examples, GraphStepsEqualEagerStepsOnCuda) {
  HIERPAR_REQUIRE_CUDA();
  TempDir dir;
  for (const char* precision : {"fp32", "bf16"}) {
    auto config = tiny_training("");
    config.data = "synthetic";
    config.device = "cuda";
    config.model.layers = hierpar::LayerSet::hierpar;
    config.precision = precision;
    config.cudnn_benchmark = false;
    config.max_steps = 8;
    config.log_every = 5;
    auto graphs = config, eager = config;
    graphs.graphs = "on";
    graphs.out = dir / (std::string("graphs_") + precision);
    eager.graphs = "off";
    eager.out = dir / (std::string("eager_") + precision);
    ASSERT_EQ(train_dcgan(graphs), 0);
    ASSERT_EQ(train_dcgan(eager), 0);
    const auto a = checkpoint_networks(graphs.out + "/checkpoint.pt", config.model);
    const auto b = checkpoint_networks(eager.out + "/checkpoint.pt", config.model);
    const auto tol = std::string(precision) == "bf16" ? hierpar::testing::tolerance_for(torch::kBFloat16)
                                                      : hierpar::testing::Tolerance{1e-5, 1e-5};
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      hierpar::testing::expect_close(a[i], b[i], tol, std::string(precision) + ": graphs vs eager tensor " + std::to_string(i));
    const auto ha = read_checkpoint_state(graphs.out + "/checkpoint.pt").history;
    const auto hb = read_checkpoint_state(eager.out + "/checkpoint.pt").history;
    ASSERT_EQ(ha.size(0), 8);
    hierpar::testing::expect_close(ha, hb, tol, std::string(precision) + ": graphs vs eager losses");
  }
}
