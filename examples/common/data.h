// Training images for the examples: Fashion-MNIST (gzip IDX), a folder of PNG/JPEG files, or synthetic;
// resized (bilinear) to the model's size with 1 or 3 channels; served in shuffled batches, normalised to
// [-1, 1], from a copy on the device when the set fits there, else streamed through pinned host memory.
// Every failure throws hierpar::examples::Error with one line naming the file and what was wrong.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace hierpar::examples {

// Where Debian's dataset-fashion-mnist installs the files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Where Fashion-MNIST is looked for by default: $HIERPAR_DATA_DIR when set (a machine without the Debian
// package, e.g. one that got the files carried by scripts/gpu-bundle), else kFashionMnistDir.
std::string default_fashion_mnist_dir();

// Images as uint8 [N, C, H, W]; labels int64 [N] when the source has them.
struct Dataset {
  torch::Tensor images;
  torch::Tensor labels;
  std::string description;  // e.g. "Fashion-MNIST train (60000 images, 1x28x28)"
};

// A gzip-compressed IDX file of unsigned bytes (magic 0x0000080N, N = number of dimensions, which must be
// `dims`). Keeps at most `max_items` items (0: all), but always reads the whole file: its length and gzip
// checksum are checked, so a truncated or damaged file is refused. Returns a uint8 tensor of the file's dimensions.
torch::Tensor read_idx_gz(const std::string& path, int dims, int64_t max_items = 0);

// Fashion-MNIST's train (60000) or test (10000) split from `dir`, at most `max_items` (0: all).
Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t max_items = 0);
// MNIST's, from the same four file names (torchvision keeps them in <root>/MNIST/raw).
Dataset load_mnist(const std::string& dir, bool train, int64_t max_items = 0);
// Where MNIST is looked for by default: $HIERPAR_MNIST_DIR when set, else data/MNIST/raw (torchvision's layout under
// its default root).
std::string default_mnist_dir();

// The image files of a folder, decoded when asked: every .png/.jpg/.jpeg (any case) in `dir` and its subfolders
// (ImageFolder's and CelebA's layouts), sorted by path, at most `limit` of them (0: all); each decoded to `channels`
// (1 or 3), cropped to its centred square and resized to `size` x `size` (antialiased).
class ImageFiles {
 public:
  ImageFiles(const std::string& dir, int64_t channels, int64_t size, int64_t limit = 0);
  int64_t count() const { return static_cast<int64_t>(files_.size()); }
  int64_t channels() const { return channels_; }
  int64_t size() const { return size_; }
  std::string description() const;
  // Decodes images `indices` (int64 [n] on the CPU) into `out` (uint8 [n, channels, size, size]) on the intra-op
  // threads; an unreadable file is an Error naming the first of them in `indices` order, by path.
  void decode(const torch::Tensor& indices, torch::Tensor& out) const;

 private:
  std::string dir_;
  std::vector<std::string> files_;
  int64_t channels_, size_;
};

// Every image of ImageFiles(dir, channels, size) decoded into memory at the training size (never at full size).
Dataset load_image_folder(const std::string& dir, int64_t channels, int64_t size);

// `count` random smooth images (blobs on a gradient), reproducible from `seed`.
Dataset make_synthetic(int64_t count, int64_t channels, int64_t size, uint64_t seed);

// Bilinear resize of uint8 [N, C, H, W] to [N, channels, size, size] (antialiased when shrinking), grey
// replicated to RGB or RGB averaged to grey (ITU-R BT.601 luma) as needed. Returns uint8.
torch::Tensor prepare_images(const torch::Tensor& images, int64_t size, int64_t channels);

// uint8 in [0, 255] -> float in [-1, 1].
torch::Tensor normalise(const torch::Tensor& images);

// Serves an epoch of shuffled batches (the last partial batch dropped) of normalised images on `device`.
// Placement: `resident` copies the whole uint8 set to the device once; `streaming` gathers each batch on
// the host (pinned memory for CUDA) in background tasks `prefetch` batches ahead and copies it asynchronously;
// `files` decodes each batch from the image files the same way (only those batches are ever in memory).
class BatchLoader {
 public:
  enum class Placement { automatic, resident, streaming, files };
  // automatic: resident on the CPU, or on CUDA when the set takes at most half of the free device memory.
  BatchLoader(torch::Tensor images, torch::Device device, int64_t batch_size, Placement placement, uint64_t seed);
  // Placement files: the same batches as BatchLoader over those files decoded into memory (same seed, same order).
  BatchLoader(std::shared_ptr<const ImageFiles> files, torch::Device device, int64_t batch_size, uint64_t seed,
              int64_t prefetch = 2);
  ~BatchLoader();

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  bool resident() const { return resident_; }
  // Starts `epoch`, whose order depends only on (seed, epoch) so that a resumed run sees the same batches;
  // `skip` batches are passed over.
  void start_epoch(int64_t epoch, int64_t skip = 0);
  // The next batch (float [batch, C, H, W] in [-1, 1] on the device), or an undefined tensor at the end.
  torch::Tensor next();

 private:
  void set_batches(int64_t count);
  torch::Tensor gather_host(int64_t batch) const;
  void fill_prefetch();
  torch::Tensor images_;                        // uint8, on the device when resident; undefined with files
  std::shared_ptr<const ImageFiles> files_;     // placement files
  torch::Device device_;
  int64_t batch_size_, batches_per_epoch_ = 0, count_ = 0, prefetch_depth_ = 1;
  uint64_t seed_;
  bool resident_ = false;
  torch::Tensor order_;  // this epoch's permutation (on images_' device)
  int64_t cursor_ = 0, scheduled_ = 0;  // the next batch to serve, the next to gather
  std::deque<std::future<torch::Tensor>> prefetch_;
};

BatchLoader::Placement parse_placement(const std::string& name);

}  // namespace hierpar::examples
