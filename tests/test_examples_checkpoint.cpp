// The examples' checkpoints (examples/common/checkpoint): truncated or foreign files, every tensor checked against
// the model, configurations that resume whatever their paths hold, and the last K kept.
#include "examples_testing.h"

namespace {

using namespace hierpar::examples_testing;

TEST(Checkpoint, TruncatedOrForeignFilesAreOneShortLine) {
  TempDir dir;
  auto config = tiny_training(dir / "out");
  config.data = "synthetic";
  config.max_steps = 1;
  ASSERT_EQ(train_dcgan(config), 0);
  std::ifstream in(dir / "out/checkpoint.pt", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(dir / "cut.pt", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  std::ofstream(dir / "junk.pt") << "not a checkpoint";
  torch::save(torch::ones({3}), dir / "foreign.pt");
  const std::vector<std::pair<std::string, std::string>> cases{
      {"cut.pt", "cut.pt: truncated or damaged checkpoint (LibTorch cannot read the archive)"},
      {"junk.pt", "junk.pt: not a hierpar checkpoint (not a LibTorch archive)"},
      {"foreign.pt", "foreign.pt: not a hierpar checkpoint (a LibTorch archive of something else)"}};
  for (const auto& [file, message] : cases) {
    try {
      read_checkpoint_state(dir / file);
      ADD_FAILURE() << file << " was read";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), (dir / file) + message.substr(file.size())) << file;
    }
    expect_one_line_error(run_dcgan("generate --device cpu --checkpoint " + (dir / file) + " --output " + (dir / "g.png"), dir),
                          message, file);
  }
}

// Every parameter, buffer and Adam state tensor is checked against the model on load, naming the entry.
TEST(Checkpoint, EveryTensorIsCheckedAgainstTheModel) {
  TempDir dir;
  hierpar::models::DCGANOptions small;
  small.image_size = 32;
  small.width = 0.25;
  small.channels = 1;
  auto wide = small;
  wide.width = 0.5;
  hierpar::models::Generator g(small), other(wide);
  torch::optim::Adam adam(g->parameters());
  g->forward(torch::randn({2, 100})).sum().backward();
  adam.step();
  CheckpointState state;
  state.history = torch::zeros({0, 3});
  save_checkpoint(dir / "g.pt", state, {{"generator", g.get()}}, {{"generator", &adam}}, torch::kCPU);

  EXPECT_ERROR_MSG(load_checkpoint(dir / "g.pt", {}, {{"generator", other.get()}}, {}, torch::kCPU),
                   "g.pt: entry module/generator/deconv1.weight is [100, 32, 4, 4] Float, the model's is [100, 64, 4, 4] "
                   "Float (a checkpoint of another model)");
  hierpar::models::Generator as_double(small);
  as_double->to(torch::kDouble);
  EXPECT_ERROR_MSG(load_checkpoint(dir / "g.pt", {}, {{"generator", as_double.get()}}, {}, torch::kCPU),
                   "entry module/generator/deconv1.weight is [100, 32, 4, 4] Float, the model's is [100, 32, 4, 4] Double");
  EXPECT_ERROR_MSG(load_checkpoint(dir / "g.pt", {}, {{"discriminator", g.get()}}, {}, torch::kCPU),
                   "g.pt: the checkpoint has no entry module/discriminator");
  torch::optim::Adam other_adam(other->parameters());
  EXPECT_ERROR_MSG(load_checkpoint(dir / "g.pt", {}, {}, {{"generator", &other_adam}}, torch::kCPU),
                   "g.pt: entry optimizer/generator parameter 0 exp_avg is [100, 32, 4, 4] Float, the parameter is "
                   "[100, 64, 4, 4] Float");
  // The matching model and optimiser load, values and all.
  hierpar::models::Generator same(small);
  torch::optim::Adam same_adam(same->parameters());
  EXPECT_NO_THROW(load_checkpoint(dir / "g.pt", {}, {{"generator", same.get()}}, {{"generator", &same_adam}}, torch::kCPU));
  for (const auto& p : same->named_parameters()) EXPECT_TRUE(p.value().equal(g->named_parameters()[p.key()])) << p.key();
}

// The configuration is stored as a dictionary: a --data path with spaces (and '=') resumes.
TEST(Checkpoint, ConfigurationWithSpacesResumes) {
  TempDir dir;
  const std::string images = dir / "my images=1";
  fs::create_directories(images);
  for (int i = 0; i < 32; ++i) write_png(images + "/" + std::to_string(100 + i) + ".png", 8, 8, 1, random_bytes(64));
  auto config = tiny_training(dir / "out");
  config.data = images;
  config.limit = 32;
  config.max_steps = 1;
  ASSERT_EQ(train_dcgan(config), 0);
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint.pt").config.at("data"), images);
  config.resume = true;
  config.max_steps = 2;
  ASSERT_EQ(train_dcgan(config), 0);
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint.pt").global_step, 2);
}

// --keep-checkpoints K keeps the newest as checkpoint.pt and the last K as checkpoint-<step>.pt; no temporary
// files stay behind.
TEST(Checkpoint, KeepsTheLastK) {
  TempDir dir;
  auto config = tiny_training(dir / "out");
  config.data = "synthetic";
  config.keep_checkpoints = 2;
  config.checkpoint_every = 1;
  config.max_steps = 5;
  ASSERT_EQ(train_dcgan(config), 0);
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir.path / "out"))
    if (entry.path().extension() == ".pt" || entry.path().string().find(".tmp") != std::string::npos)
      files.push_back(entry.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"checkpoint-00000004.pt", "checkpoint-00000005.pt", "checkpoint.pt"}));
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint.pt").global_step, 5);
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint-00000004.pt").global_step, 4);
  EXPECT_EQ(numbered_checkpoint(dir / "out/checkpoint.pt", 4), dir / "out/checkpoint-00000004.pt");

  auto one = tiny_training(dir / "one");
  one.data = "synthetic";
  one.checkpoint_every = 1;
  one.max_steps = 3;
  ASSERT_EQ(train_dcgan(one), 0);
  int entries = 0;
  for (const auto& entry : fs::directory_iterator(dir.path / "one")) entries += entry.path().extension() == ".pt";
  EXPECT_EQ(entries, 1) << "the default keeps checkpoint.pt alone";
}

// An --out that cannot be written is refused before any data is read or any step trained.

}  // namespace
