// The examples' data loading (examples/common/data): IDX files (Fashion-MNIST, MNIST) and their errors, image folders
// decoded at once or streamed, synthetic data, and the batch loader.
#include "examples_testing.h"

namespace {

using namespace hierpar::examples_testing;

// ---- IDX / Fashion-MNIST -------------------------------------------------------------------------------

TEST(Data, IdxGzipRoundTrip) {
  TempDir dir;
  const uint32_t n = static_cast<uint32_t>(rand_int(1, 20)), h = static_cast<uint32_t>(rand_int(1, 9));
  const auto bytes = random_bytes(n * h * 3);
  write_gz(dir / "x.gz", idx_bytes({n, h, 3}, bytes));
  auto t = read_idx_gz(dir / "x.gz", 3);
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{n, h, 3}));
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), t.data_ptr<uint8_t>()));
  auto first = read_idx_gz(dir / "x.gz", 3, 1);
  EXPECT_EQ(first.size(0), 1);
  EXPECT_TRUE(first[0].equal(t[0]));
}

TEST(Data, FashionMnistLayoutFromSmallFiles) {
  TempDir dir;
  write_fake_mnist(dir.path.string(), "train", 12);
  auto set = load_fashion_mnist(dir.path.string(), true);
  EXPECT_EQ(set.images.sizes(), (std::vector<int64_t>{12, 1, 28, 28}));
  EXPECT_EQ(set.labels.sizes(), (std::vector<int64_t>{12}));
  EXPECT_LE(set.labels.max().item<int64_t>(), 9);
  EXPECT_EQ(load_fashion_mnist(dir.path.string(), true, 5).images.size(0), 5);
}

// MNIST has Fashion-MNIST's file layout; the program trains on it with --data mnist --mnist-dir.
TEST(Data, MnistFromSmallFilesAndTheProgramTrainsOnIt) {
  TempDir dir;
  write_fake_mnist(dir.path.string(), "train", 40);
  const auto set = load_mnist(dir.path.string(), true);
  EXPECT_EQ(set.images.sizes(), (std::vector<int64_t>{40, 1, 28, 28}));
  EXPECT_EQ(set.description.rfind("MNIST train (40 images", 0), 0u) << set.description;
  const auto run = run_dcgan("train --device cpu --data mnist --mnist-dir " + dir.path.string() + " --batch-size 16 "
                             "--image-size 32 --width 0.25 --samples 4 --epochs 1 --out " + (dir / "out"), dir);
  ASSERT_EQ(run.status, 0) << c10::Join("\n", run.stderr_lines);
  EXPECT_EQ(read_checkpoint_state(dir / "out/checkpoint.pt").global_step, 2);
}

TEST(Data, RealFashionMnistIfInstalled) {
  if (!have_fashion_mnist()) GTEST_SKIP() << default_fashion_mnist_dir() << " not installed (Debian's dataset-fashion-mnist)";
  auto test = load_fashion_mnist(default_fashion_mnist_dir(), false);
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(torch::bincount(test.labels).eq(1000).all().item<bool>(), true) << "the test split has 1000 per class";
}

TEST(Data, IdxMissingFile) {
  TempDir dir;
  EXPECT_ERROR_MSG(load_fashion_mnist(dir.path.string(), true), "train-images-idx3-ubyte.gz: no such file");
}

TEST(Data, IdxWrongMagic) {
  TempDir dir;
  write_gz(dir / "x.gz", idx_bytes({4, 28, 28}, random_bytes(4 * 28 * 28), /*type=*/0x0D));  // float IDX
  EXPECT_ERROR_MSG(read_idx_gz(dir / "x.gz", 3), "not an IDX file of unsigned bytes with 3 dimensions (magic 0x00000d03");
  write_gz(dir / "y.gz", idx_bytes({4}, random_bytes(4)));
  EXPECT_ERROR_MSG(read_idx_gz(dir / "y.gz", 3), "(magic 0x00000801, expected 0x00000803)");
}

TEST(Data, IdxTruncatedGzip) {
  TempDir dir;
  write_gz(dir / "full.gz", idx_bytes({50, 28, 28}, random_bytes(50 * 28 * 28)));
  std::ifstream in(dir / "full.gz", std::ios::binary);
  std::string gz((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(dir / "cut.gz", std::ios::binary) << gz.substr(0, gz.size() / 2);
  EXPECT_ERROR_MSG(read_idx_gz(dir / "cut.gz", 3), "cut.gz: truncated while reading the data");
  // A complete gzip stream whose header promises more items than it holds.
  write_gz(dir / "short.gz", idx_bytes({50, 28, 28}, random_bytes(10 * 28 * 28)));
  EXPECT_ERROR_MSG(read_idx_gz(dir / "short.gz", 3), "short.gz: truncated while reading the data");
}

// Damaged bytes that still inflate (here in stored blocks, as deflate keeps incompressible data) show only in the
// gzip trailer's CRC-32, which the whole file is read for, also when fewer items are kept.
TEST(Data, IdxCorruptGzipIsRefused) {
  TempDir dir;
  // Large enough that the data is read before zlib reaches the trailer (its buffers hold a few kB).
  const std::string bytes = idx_bytes({400, 28, 28}, random_bytes(400 * 28 * 28));
  gzFile f = gzopen((dir / "stored.gz").c_str(), "wb0");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  gzclose(f);
  std::ifstream in(dir / "stored.gz", std::ios::binary);
  std::string gz((std::istreambuf_iterator<char>(in)), {});
  gz[gz.size() * 3 / 4] = static_cast<char>(gz[gz.size() * 3 / 4] ^ 0x5a);
  std::ofstream(dir / "damaged.gz", std::ios::binary) << gz;
  EXPECT_ERROR_MSG(read_idx_gz(dir / "damaged.gz", 3), "damaged.gz: corrupt while reading the data (incorrect data check)");
  EXPECT_ERROR_MSG(read_idx_gz(dir / "damaged.gz", 3, 1), "damaged.gz: corrupt while reading the data (incorrect data check)");
  EXPECT_NO_THROW(read_idx_gz(dir / "stored.gz", 3));
  // More data than the header describes.
  write_gz(dir / "long.gz", idx_bytes({2, 28, 28}, random_bytes(3 * 28 * 28)));
  EXPECT_ERROR_MSG(read_idx_gz(dir / "long.gz", 3), "long.gz: 784 bytes past the data its IDX header describes");
  // The program refuses such a data set before training, in one line.
  fs::create_directories(dir.path / "mnist");
  fs::copy_file(dir / "damaged.gz", dir / "mnist/train-images-idx3-ubyte.gz");
  write_gz(dir / "mnist/train-labels-idx1-ubyte.gz", idx_bytes({400}, random_bytes(400, 9)));
  expect_one_line_error(run_dcgan("train --device cpu --out " + (dir / "out") + " --fashion-mnist-dir " + (dir / "mnist"), dir),
                        "train-images-idx3-ubyte.gz: corrupt while reading the data (incorrect data check)", "damaged data set");
  EXPECT_FALSE(fs::exists(dir / "out/checkpoint.pt"));
}

// ---- image folders ---------------------------------------------------------------------------------------

// Square images at the training size load exactly, from subfolders too (ImageFolder's class folders), sorted by path.
TEST(Data, ImageFolderLoadsSortedPngs) {
  TempDir dir;
  const int side = static_cast<int>(rand_int(3, 12));
  auto a = random_bytes(side * side * 3), b = random_bytes(side * side * 3);
  fs::create_directories(dir.path / "class_b");
  write_png(dir / "class_b/b.png", side, side, 3, b);
  write_png(dir / "a.PNG", side, side, 3, a);
  std::ofstream(dir / "notes.txt") << "ignored";
  auto set = load_image_folder(dir.path.string(), 3, side);
  ASSERT_EQ(set.images.sizes(), (std::vector<int64_t>{2, 3, side, side}));
  auto expected_a = torch::from_blob(a.data(), {side, side, 3}, torch::kUInt8).permute({2, 0, 1});
  auto expected_b = torch::from_blob(b.data(), {side, side, 3}, torch::kUInt8).permute({2, 0, 1});
  EXPECT_TRUE(set.images[0].equal(expected_a)) << "a.PNG first, CHW";
  EXPECT_TRUE(set.images[1].equal(expected_b)) << "class_b/b.png second";
  EXPECT_EQ(load_image_folder(dir.path.string(), 1, side).images.sizes(), (std::vector<int64_t>{2, 1, side, side}));
}

TEST(Data, ImageFolderEmpty) {
  TempDir dir;
  std::ofstream(dir / "readme.txt") << "no images";
  EXPECT_ERROR_MSG(load_image_folder(dir.path.string(), 3, 8), "no .png, .jpg or .jpeg images in this folder");
  EXPECT_ERROR_MSG(load_image_folder(dir / "missing", 3, 8), "not a directory");
}

// Images of any size: each is cropped to its centred square and resized to the training size as it is decoded.
TEST(Data, ImageFolderCropsAndResizesEachImage) {
  TempDir dir;
  auto a = random_bytes(8 * 8), b = random_bytes(12 * 6);
  write_png(dir / "a.png", 8, 8, 1, a);
  write_png(dir / "b.png", 12, 6, 1, b);  // 12 wide, 6 high: columns 3..8 are its centred square
  const auto set = load_image_folder(dir.path.string(), 1, 4);
  ASSERT_EQ(set.images.sizes(), (std::vector<int64_t>{2, 1, 4, 4}));
  const auto a_image = torch::from_blob(a.data(), {1, 1, 8, 8}, torch::kUInt8);
  const auto b_square = torch::from_blob(b.data(), {1, 1, 6, 12}, torch::kUInt8).narrow(3, 3, 6).contiguous();
  EXPECT_TRUE(set.images[0].equal(prepare_images(a_image, 4, 1)[0]));
  EXPECT_TRUE(set.images[1].equal(prepare_images(b_square, 4, 1)[0]));
  EXPECT_NE(set.description.find("2 images, centre squares resized to 1x4x4"), std::string::npos) << set.description;
}

TEST(Data, ImageFolderUnreadableImage) {
  TempDir dir;
  write_png(dir / "a.png", 8, 8, 1, random_bytes(64));
  std::ofstream(dir / "broken.jpg") << "this is not a JPEG";
  std::ofstream(dir / "c_broken.png") << "nor is this a PNG";
  EXPECT_ERROR_MSG(load_image_folder(dir.path.string(), 3, 8), "broken.jpg: cannot read image");  // the first by path
}

// Placement files: batches decoded from the image files as they are read are those of the folder decoded into
// memory, batch for batch, over two epochs and after a resume's skip, with more batches gathered ahead than one.
TEST(Data, ImageFilesStreamTheBatchesOfTheDecodedFolder) {
  TempDir dir;
  fs::create_directories(dir.path / "class_a");
  const int64_t count = rand_int(9, 14);
  for (int64_t i = 0; i < count; ++i) {
    const int w = static_cast<int>(rand_int(6, 20)), h = static_cast<int>(rand_int(6, 20));
    write_png(dir / ((i % 2 ? "class_a/" : "") + std::to_string(100 + i) + ".png"), w, h, 3, random_bytes(w * h * 3));
  }
  const int64_t batch = rand_int(2, 4);
  const auto decoded = load_image_folder(dir.path.string(), 3, 8);
  BatchLoader in_memory(decoded.images, torch::kCPU, batch, BatchLoader::Placement::streaming, 5);
  BatchLoader from_files(std::make_shared<const ImageFiles>(dir.path.string(), 3, 8), torch::kCPU, batch, 5,
                         /*prefetch=*/3);
  ASSERT_EQ(from_files.batches_per_epoch(), in_memory.batches_per_epoch());
  for (const auto& [epoch, skip] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {1, 0}, {2, 1}}) {
    in_memory.start_epoch(epoch, skip);
    from_files.start_epoch(epoch, skip);
    int64_t served = 0;
    for (auto a = in_memory.next(), b = from_files.next(); a.defined(); a = in_memory.next(), b = from_files.next()) {
      ASSERT_TRUE(b.defined()) << "epoch " << epoch << ": files ran out first";
      EXPECT_TRUE(a.equal(b)) << "epoch " << epoch << ", batch " << served + skip;
      ++served;
    }
    EXPECT_FALSE(from_files.next().defined());
    EXPECT_EQ(served, in_memory.batches_per_epoch() - skip);
  }
  EXPECT_EQ(ImageFiles(dir.path.string(), 3, 8, /*limit=*/4).count(), 4);
}

// An unreadable file among the files is reported, by path, by the batch that reads it.
TEST(Data, ImageFilesUnreadableImageIsReportedByItsBatch) {
  TempDir dir;
  write_png(dir / "a.png", 8, 8, 1, random_bytes(64));
  write_png(dir / "b.png", 8, 8, 1, random_bytes(64));
  std::ofstream(dir / "c_broken.png") << "not a PNG";
  BatchLoader loader(std::make_shared<const ImageFiles>(dir.path.string(), 1, 8), torch::kCPU, 3, 1);
  loader.start_epoch(0);
  EXPECT_ERROR_MSG(loader.next(), "c_broken.png: cannot read image");
}

TEST(Data, PrepareResizesConvertsAndNormalises) {
  const int64_t n = rand_int(1, 4), size = std::vector<int64_t>{32, 64}[rand_int(0, 1)];
  auto grey = torch::randint(0, 256, {n, 1, 28, 28}, torch::kUInt8);
  auto out = prepare_images(grey, size, 3);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{n, 3, size, size}));
  EXPECT_TRUE(out.select(1, 0).equal(out.select(1, 2))) << "grey replicated to RGB";
  auto reference = torch::nn::functional::interpolate(
      grey.to(torch::kFloat), torch::nn::functional::InterpolateFuncOptions()
                                  .size(std::vector<int64_t>{size, size})
                                  .mode(torch::kBilinear)
                                  .align_corners(false));
  // Rounded to uint8: within half a grey level of the float bilinear resize.
  EXPECT_LE((out.select(1, 1).to(torch::kFloat) - reference.squeeze(1)).abs().max().item<double>(), 0.5 + 1e-3);
  auto constant = torch::full({1, 3, 40, 40}, 200, torch::kUInt8);
  EXPECT_TRUE(prepare_images(constant, 32, 1).eq(200).all().item<bool>()) << "shrinking a flat image keeps it flat";
  auto edges = normalise(torch::tensor({0, 255}, torch::kUInt8));
  EXPECT_EQ(edges[0].item<float>(), -1.0f);
  EXPECT_EQ(edges[1].item<float>(), 1.0f);
}

TEST(Data, SyntheticIsReproducible) {
  auto a = make_synthetic(5, 3, 32, 11), b = make_synthetic(5, 3, 32, 11), c = make_synthetic(5, 3, 32, 12);
  EXPECT_TRUE(a.images.equal(b.images));
  EXPECT_FALSE(a.images.equal(c.images));
  EXPECT_GT(a.images.to(torch::kFloat).std().item<double>(), 10.0) << "not a flat image";
}

// ---- batches ----------------------------------------------------------------------------------------------

TEST(Data, BatchLoaderServesEveryImageOncePerEpoch) {
  const int64_t n = rand_int(20, 60), batch = rand_int(1, 7);
  // Image i is filled with the value i, so a batch tells which images it holds.
  auto images = torch::arange(n, torch::kUInt8).view({n, 1, 1, 1}).expand({n, 1, 2, 2}).contiguous();
  for (auto placement : {BatchLoader::Placement::resident, BatchLoader::Placement::streaming}) {
    BatchLoader loader(images, torch::kCPU, batch, placement, 3);
    EXPECT_EQ(loader.batches_per_epoch(), n / batch);
    std::vector<int64_t> seen;
    loader.start_epoch(0);
    for (auto b = loader.next(); b.defined(); b = loader.next()) {
      ASSERT_EQ(b.sizes(), (std::vector<int64_t>{batch, 1, 2, 2}));
      auto ids = ((b.select(1, 0).select(1, 0).select(1, 0) + 1) * 127.5).round().to(torch::kLong);
      for (int64_t i = 0; i < batch; ++i) seen.push_back(ids[i].item<int64_t>());
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(static_cast<int64_t>(seen.size()), n / batch * batch);
    EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end()) << "an image came twice in one epoch";
    // Resuming an epoch after k batches gives the same remaining batches.
    const int64_t k = rand_int(0, loader.batches_per_epoch() - 1);
    loader.start_epoch(1);
    std::vector<torch::Tensor> full;
    for (auto b = loader.next(); b.defined(); b = loader.next()) full.push_back(b);
    loader.start_epoch(1, k);
    for (size_t i = static_cast<size_t>(k); i < full.size(); ++i) EXPECT_TRUE(loader.next().equal(full[i]));
    EXPECT_FALSE(loader.next().defined());
  }
}

TEST(Data, BatchLoaderRejectsBadBatchSizes) {
  auto images = torch::zeros({10, 1, 4, 4}, torch::kUInt8);
  EXPECT_ERROR_MSG(BatchLoader(images, torch::kCPU, 0, BatchLoader::Placement::resident, 0), "batch size must be at least 1, got 0");
  EXPECT_ERROR_MSG(BatchLoader(images, torch::kCPU, 11, BatchLoader::Placement::resident, 0), "10 images, fewer than one batch of 11");
}

}  // namespace
