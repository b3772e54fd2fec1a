// Training images for the examples: Fashion-MNIST (gzip IDX), a folder of PNG/JPEG files, or synthetic;
// resized (bilinear) to the model's size with 1 or 3 channels; served in shuffled batches, normalised to
// [-1, 1], from a copy on the device when the set fits there, else streamed through pinned host memory.
// Every failure throws hierpar::examples::Error with one line naming the file and what was wrong.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <future>
#include <string>

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

// Every .png/.jpg/.jpeg (any case) in `dir` and its subfolders (ImageFolder's and CelebA's layouts), sorted by
// path, decoded to `channels` (1 or 3) on several threads, each cropped to its centred square and resized to
// `size` x `size` (antialiased) as it is decoded. An unreadable file is an Error naming the first, by path.
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
// the host (pinned memory for CUDA) in a background task one batch ahead and copies it asynchronously.
class BatchLoader {
 public:
  enum class Placement { automatic, resident, streaming };
  // automatic: resident on the CPU, or on CUDA when the set takes at most half of the free device memory.
  BatchLoader(torch::Tensor images, torch::Device device, int64_t batch_size, Placement placement, uint64_t seed);
  ~BatchLoader();

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  bool resident() const { return resident_; }
  // Starts `epoch`, whose order depends only on (seed, epoch) so that a resumed run sees the same batches;
  // `skip` batches are passed over.
  void start_epoch(int64_t epoch, int64_t skip = 0);
  // The next batch (float [batch, C, H, W] in [-1, 1] on the device), or an undefined tensor at the end.
  torch::Tensor next();

 private:
  torch::Tensor gather_host(int64_t batch) const;
  torch::Tensor images_;  // uint8, on the device when resident
  torch::Device device_;
  int64_t batch_size_, batches_per_epoch_;
  uint64_t seed_;
  bool resident_ = false;
  torch::Tensor order_;  // this epoch's permutation (on images_' device)
  int64_t cursor_ = 0;
  std::future<torch::Tensor> prefetch_;
};

BatchLoader::Placement parse_placement(const std::string& name);

}  // namespace hierpar::examples
