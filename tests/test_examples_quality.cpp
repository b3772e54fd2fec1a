// The sample-quality metric (examples/common/quality, hierpar-dcgan evaluate): the Frechet distance against known
// Gaussians, a trained generator scoring better than an untrained one, and train --eval-every logging it.
#include "examples_testing.h"

#include <ATen/CPUGeneratorImpl.h>

using namespace hierpar::examples_testing;

// ---- the sample-quality metric (hierpar-dcgan evaluate) --------------------------------------------------------------

// Gaussians with known distance: N(0, I) against N(mu, I) is |mu|^2, and N(0, I) against N(0, s^2 I) in D
// dimensions is D (1 - s)^2.
TEST(Quality, FrechetDistanceOfKnownGaussians) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto a = torch::randn({40000, 3}, gen, torch::kDouble), b = torch::randn({40000, 3}, gen, torch::kDouble);
  const auto mu = torch::tensor({1.0, -2.0, 0.5}, torch::kDouble);
  EXPECT_NEAR(hierpar::examples::frechet_distance(a, b), 0.0, 0.01);
  EXPECT_NEAR(hierpar::examples::frechet_distance(a, b + mu), 5.25, 0.05);
  EXPECT_NEAR(hierpar::examples::frechet_distance(a, b * 3), 3 * 4.0, 0.3);  // sampling error of the covariances ~0.2
  EXPECT_THROW(hierpar::examples::frechet_distance(a, torch::randn({10, 4}, torch::kDouble)), c10::Error);
}

// Where the tests keep the quality metric's classifier (not in the user's cache): the programs find it through
// XDG_CACHE_HOME.
namespace {
constexpr const char* kTestCacheHome = "/tmp/hierpar-test-cache";
std::string test_classifier_cache() { return std::string(kTestCacheHome) + "/hierpar/fashion-mnist-classifier.pt"; }
}  // namespace

// On Fashion-MNIST: the real training images score near 0 against the test images with every class covered, a
// briefly trained generator scores better than an untrained one, and `evaluate` prints both figures.
TEST(Quality, TrainedGeneratorScoresBetterThanUntrained) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (Debian's dataset-fashion-mnist)";
  TempDir dir;
  // The classifier is trained once (about 30 s on two cores) and kept for later runs of the suite.
  const std::string cache = test_classifier_cache();
  std::ostringstream log;
  auto classifier = hierpar::examples::fashion_mnist_classifier(default_fashion_mnist_dir(), cache, log);

  const auto real = hierpar::examples::evaluate_images(
      load_fashion_mnist(default_fashion_mnist_dir(), true, 2000).images, 32, *classifier,
      hierpar::examples::real_test_features(*classifier, default_fashion_mnist_dir(), 32));
  EXPECT_EQ(real.covered_classes, 10) << real.to_string();

  const std::string train = "train --device cpu --data fashion-mnist --image-size 32 --width 0.5 --epochs 1 "
                            "--limit 19200 --samples 4 --out " + dir / "run";
  ASSERT_EQ(run_dcgan(train, dir).status, 0);
  auto trained = hierpar::examples::load_generator(dir / "run/checkpoint.pt", hierpar::LayerSet::hierpar, torch::kCPU);
  torch::manual_seed(5);
  hierpar::models::Generator untrained(trained->options);
  const auto good = hierpar::examples::evaluate_generator(*trained, *classifier, default_fashion_mnist_dir(), 2000, 1);
  const auto bad = hierpar::examples::evaluate_generator(*untrained, *classifier, default_fashion_mnist_dir(), 2000, 1);
  EXPECT_LT(good.fid, 0.5 * bad.fid) << "trained: " << good.to_string() << "\nuntrained: " << bad.to_string();
  EXPECT_LT(real.fid, 0.1 * good.fid) << "real: " << real.to_string() << "\ntrained: " << good.to_string();
  EXPECT_GT(good.covered_classes, bad.covered_classes) << good.to_string() << "\n" << bad.to_string();

  const std::string out = dcgan_stdout("evaluate --device cpu --samples 500 --checkpoint " + dir / "run/checkpoint.pt" +
                                       " --classifier " + cache);
  EXPECT_NE(out.find("500 samples: FID (seed-CNN features) "), std::string::npos) << out;
  EXPECT_NE(out.find("for scale, 500 Fashion-MNIST training images: FID"), std::string::npos) << out;
}

// train --eval-every: rank 0 scores samples every N steps into quality.csv and quality.png; a resumed run keeps the
// rows up to its checkpoint. Only Fashion-MNIST has the metric.
TEST(Quality, TrainLogsTheMetricEveryNSteps) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "Fashion-MNIST is not installed (Debian's dataset-fashion-mnist)";
  TempDir dir;
  const std::string train = std::string("XDG_CACHE_HOME=") + kTestCacheHome + " " + HIERPAR_DCGAN_PROGRAM +
                            " train --device cpu --data fashion-mnist --limit 6400 --image-size 32 --width 0.25 "
                            "--samples 4 --eval-every 50 --eval-samples 200 --out " + dir / "run";
  ASSERT_EQ(std::system((train + " --epochs 1 > /dev/null 2>&1").c_str()), 0);
  auto rows = [&] {
    std::ifstream in(dir / "run/quality.csv");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  };
  auto first = rows();
  ASSERT_EQ(first.size(), 3u) << "header and steps 50, 100";
  EXPECT_EQ(first[0], "step,epoch,fid,classes_covered");
  EXPECT_EQ(first[1].rfind("50,1,", 0), 0u) << first[1];
  EXPECT_EQ(first[2].rfind("100,1,", 0), 0u) << first[2];
  int w = 0, h = 0, c = 0;
  EXPECT_EQ(stbi_info((dir / "run/quality.png").c_str(), &w, &h, &c), 1);
  ASSERT_EQ(std::system((train + " --epochs 2 --resume > /dev/null 2>&1").c_str()), 0);
  auto second = rows();
  ASSERT_EQ(second.size(), 5u);
  EXPECT_EQ(second[2], first[2]) << "the first run's rows are kept";
  EXPECT_EQ(second[4].rfind("200,2,", 0), 0u) << second[4];
  // Several runs' FID on one plot: `plot --metric fid` reads quality.csv files, and refuses a losses.csv in a line.
  const std::string plotted = dcgan_stdout("plot --metric fid --output " + (dir / "fid.png") + " --runs a=" +
                                           (dir / "run/quality.csv") + ",b=" + (dir / "run/quality.csv"));
  EXPECT_NE(plotted.find("a: 4 evaluations; last FID"), std::string::npos) << plotted;
  EXPECT_EQ(stbi_info((dir / "fid.png").c_str(), &w, &h, &c), 1);
  expect_one_line_error(run_dcgan("plot --metric fid --output " + (dir / "x.png") + " --runs a=" + (dir / "run/losses.csv"), dir),
                        "not a quality.csv", "a losses.csv as FID");
  expect_flag_error(run_dcgan("plot --metric psnr --output " + (dir / "x.png") + " --runs a=" + (dir / "run/losses.csv"), dir),
                    "--metric: expected loss or fid, got 'psnr'", "unknown metric");
  expect_flag_error(run_dcgan("train --device cpu --data synthetic --eval-every 10 --out " + dir / "bad", dir),
                    "--eval-every: the quality metric is for --data fashion-mnist", "eval on synthetic data");
}
