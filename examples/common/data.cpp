#include "common/data.h"

#include "common/cli.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/cuda.h>
#ifdef HIERPAR_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <zlib.h>

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_FAILURE_USERMSG
#include <stb/stb_image.h>

#include <algorithm>
#include <cstdlib>
#include <array>
#include <cctype>
#include <filesystem>
#include <memory>
#include <sstream>

namespace hierpar::examples {
namespace fs = std::filesystem;

namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

// Throws naming the file and what was being read: a read that ends early is a truncated file, a zlib error
// (a bad deflate block, or the trailer's CRC-32 or length) a corrupt one.
[[noreturn]] void gzip_failure(gzFile file, const std::string& path, int got, const char* what) {
  int code = Z_OK;
  const char* msg = gzerror(file, &code);
  std::string reason = msg && *msg ? msg : "unexpected end of file";
  if (reason.rfind(path + ": ", 0) == 0) reason = reason.substr(path.size() + 2);  // zlib repeats the path
  const bool eof = got == 0 || code == Z_BUF_ERROR;
  throw Error(path + ": " + (eof ? "truncated" : "corrupt") + " while reading the " + what + " (" + reason + ")");
}

// Reads exactly n bytes or throws naming the file.
void read_exact(gzFile file, const std::string& path, void* out, size_t n, const char* what) {
  auto* dst = static_cast<unsigned char*>(out);
  while (n > 0) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n, 1u << 30));
    const int got = gzread(file, dst, chunk);
    if (got <= 0) gzip_failure(file, path, got, what);
    dst += got;
    n -= static_cast<size_t>(got);
  }
}

// Reads the stream to its end: `expected` more bytes, then nothing. Only there does zlib check the gzip
// trailer (CRC-32 and length), the one sign of damaged bytes that still inflate (e.g. in stored blocks).
void read_to_end(gzFile file, const std::string& path, int64_t expected) {
  std::vector<unsigned char> buffer(1 << 16);
  int64_t got_total = 0;
  for (;;) {
    const int got = gzread(file, buffer.data(), static_cast<unsigned>(buffer.size()));
    int code = Z_OK;
    gzerror(file, &code);
    if (got < 0 || code != Z_OK) gzip_failure(file, path, got < 0 ? -1 : 1, "data");
    if (got == 0) break;
    got_total += got;
  }
  if (got_total < expected) throw Error(path + ": truncated while reading the data (unexpected end of file)");
  if (got_total > expected)
    throw Error(path + ": " + std::to_string(got_total - expected) + " bytes past the data its IDX header describes");
}

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

torch::Tensor read_idx_gz(const std::string& path, int dims, int64_t max_items) {
  if (!fs::exists(path)) throw Error(path + ": no such file");
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  if (!file) throw Error(path + ": cannot open");
  unsigned char magic[4];
  read_exact(file.get(), path, magic, 4, "IDX header");
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] != dims) {
    char found[16];
    std::snprintf(found, sizeof found, "0x%02x%02x%02x%02x", magic[0], magic[1], magic[2], magic[3]);
    throw Error(path + ": not an IDX file of unsigned bytes with " + std::to_string(dims) +
                " dimensions (magic " + found + ", expected 0x000008" + (dims < 16 ? "0" : "") +
                std::to_string(dims) + ")");
  }
  std::vector<int64_t> sizes(dims);
  for (int d = 0; d < dims; ++d) {
    unsigned char b[4];
    read_exact(file.get(), path, b, 4, "IDX header");
    sizes[d] = big_endian(b);
    if (sizes[d] == 0 || sizes[d] > (int64_t{1} << 28))
      throw Error(path + ": implausible IDX dimension " + std::to_string(d) + " of size " + std::to_string(sizes[d]));
  }
  const int64_t items = sizes[0];
  if (max_items > 0) sizes[0] = std::min(sizes[0], max_items);
  auto out = torch::empty(sizes, torch::kUInt8);
  read_exact(file.get(), path, out.data_ptr<uint8_t>(), static_cast<size_t>(out.numel()), "data");
  read_to_end(file.get(), path, (items - sizes[0]) * (out.numel() / std::max<int64_t>(1, sizes[0])));
  return out;
}

Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t max_items) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  auto images = read_idx_gz(prefix + "-images-idx3-ubyte.gz", 3, max_items);
  auto labels = read_idx_gz(prefix + "-labels-idx1-ubyte.gz", 1, max_items);
  if (images.size(0) != labels.size(0))
    throw Error(prefix + "-*: " + std::to_string(images.size(0)) + " images but " + std::to_string(labels.size(0)) +
                " labels");
  if (labels.max().item<int64_t>() > 9) throw Error(prefix + "-labels-idx1-ubyte.gz: a label is not in 0..9");
  std::ostringstream desc;
  desc << "Fashion-MNIST " << (train ? "train" : "test") << " (" << images.size(0) << " images, 1x"
       << images.size(1) << "x" << images.size(2) << ", " << dir << ")";
  return {images.unsqueeze(1), labels.to(torch::kLong), desc.str()};
}

Dataset load_image_folder(const std::string& dir, int64_t channels, int64_t size) {
  if (!fs::is_directory(dir)) throw Error(dir + ": not a directory (--data takes fashion-mnist, synthetic or a folder of images)");
  if (size < 1) throw Error("load_image_folder: size must be at least 1, got " + std::to_string(size));
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink)) {
    const auto ext = lower(entry.path().extension().string());
    if (entry.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg")) files.push_back(entry.path());
  }
  if (files.empty()) throw Error(dir + ": no .png, .jpg or .jpeg images in this folder or below it");
  std::sort(files.begin(), files.end());
  const auto n = static_cast<int64_t>(files.size());
  // Decoded on several threads, each image cropped and resized at once: the set is held at its training size,
  // never at full size. Failures are kept per file, and the first in name order is reported.
  auto images = torch::empty({n, channels, size, size}, torch::kUInt8);
  std::vector<std::string> errors(files.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const std::string path = files[i].string();
      int w = 0, h = 0, found = 0;
      std::unique_ptr<stbi_uc, void (*)(void*)> pixels(stbi_load(path.c_str(), &w, &h, &found, static_cast<int>(channels)),
                                                       stbi_image_free);
      if (!pixels) {
        errors[i] = path + ": cannot read image (" + stbi_failure_reason() + ")";
        continue;
      }
      // stb gives interleaved HWC; the centred square is what a DCGAN trains on (CelebA's 178x218, for one).
      const int side = std::min(w, h);
      const auto square = torch::from_blob(pixels.get(), {h, w, channels}, torch::kUInt8)
                              .narrow(0, (h - side) / 2, side)
                              .narrow(1, (w - side) / 2, side)
                              .permute({2, 0, 1})
                              .unsqueeze(0)
                              .contiguous();
      images[i].copy_(prepare_images(square, size, channels)[0]);
    }
  });
  for (const auto& error : errors) {
    if (!error.empty()) throw Error(error);
  }
  std::ostringstream desc;
  desc << "image folder " << dir << " (" << n << " images, centre squares resized to " << channels << "x" << size << "x"
       << size << ")";
  return {images, torch::Tensor(), desc.str()};
}

Dataset make_synthetic(int64_t count, int64_t channels, int64_t size, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat);
  auto coords = torch::linspace(-1, 1, size, opts);
  auto yy = coords.view({1, 1, size, 1}), xx = coords.view({1, 1, 1, size});
  auto param = [&](double lo, double hi) {
    return at::rand({count, channels, 1, 1}, gen, opts) * (hi - lo) + lo;
  };
  // A soft ellipse on a linear gradient, per channel: varied but learnable structure.
  auto cx = param(-0.5, 0.5), cy = param(-0.5, 0.5), rx = param(0.2, 0.6), ry = param(0.2, 0.6);
  auto blob = torch::exp(-((xx - cx) / rx).square() - ((yy - cy) / ry).square());
  auto gradient = param(-0.3, 0.3) * xx + param(-0.3, 0.3) * yy;
  auto images = (blob * 0.8 + gradient + 0.3).clamp(0, 1);
  std::ostringstream desc;
  desc << "synthetic (" << count << " images, " << channels << "x" << size << "x" << size << ")";
  return {(images * 255).round().to(torch::kUInt8), torch::Tensor(), desc.str()};
}

torch::Tensor prepare_images(const torch::Tensor& images, int64_t size, int64_t channels) {
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == torch::kUInt8, "prepare_images: expected uint8 [N, C, H, W]");
  const int64_t n = images.size(0), c = images.size(1);
  if (c != channels && c != 1 && c != 3)
    throw Error("images have " + std::to_string(c) + " channels; only 1 and 3 can be converted");
  auto out = torch::empty({n, channels, size, size}, torch::kUInt8);
  const bool same_size = images.size(2) == size && images.size(3) == size;
  const bool shrinking = images.size(2) > size || images.size(3) > size;
  constexpr int64_t kChunk = 1024;  // bounds the float working memory
  for (int64_t start = 0; start < n; start += kChunk) {
    auto x = images.slice(0, start, std::min(n, start + kChunk)).to(torch::kFloat);
    if (c == 3 && channels == 1) {
      x = (x.select(1, 0) * 0.299 + x.select(1, 1) * 0.587 + x.select(1, 2) * 0.114).unsqueeze(1);
    }
    if (!same_size) {
      namespace F = torch::nn::functional;
      x = F::interpolate(x, F::InterpolateFuncOptions()
                                .size(std::vector<int64_t>{size, size})
                                .mode(torch::kBilinear)
                                .align_corners(false)
                                .antialias(shrinking));
    }
    if (c == 1 && channels == 3) x = x.expand({x.size(0), 3, size, size});
    out.slice(0, start, start + x.size(0)).copy_(x.round().clamp_(0, 255));
  }
  return out;
}

torch::Tensor normalise(const torch::Tensor& images) { return images.to(torch::kFloat).div_(127.5).sub_(1.0); }

BatchLoader::Placement parse_placement(const std::string& name) {
  if (name == "auto") return BatchLoader::Placement::automatic;
  if (name == "device") return BatchLoader::Placement::resident;
  if (name == "stream") return BatchLoader::Placement::streaming;
  throw FlagError("--data-placement: expected auto, device or stream, got '" + name + "'");
}

BatchLoader::BatchLoader(torch::Tensor images, torch::Device device, int64_t batch_size, Placement placement,
                         uint64_t seed)
    : device_(device), batch_size_(batch_size), seed_(seed) {
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == torch::kUInt8, "BatchLoader: expected uint8 [N, C, H, W]");
  if (batch_size < 1) throw Error("batch size must be at least 1, got " + std::to_string(batch_size));
  if (images.size(0) < batch_size)
    throw Error("the data set has " + std::to_string(images.size(0)) + " images, fewer than one batch of " +
                std::to_string(batch_size));
  batches_per_epoch_ = images.size(0) / batch_size;
  if (placement == Placement::automatic) {
    resident_ = true;
#ifdef HIERPAR_WITH_CUDA
    if (device.is_cuda()) {
      size_t free_bytes = 0, total_bytes = 0;
      cudaSetDevice(device.has_index() ? device.index() : 0);
      resident_ = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess &&
                  static_cast<size_t>(images.nbytes()) <= free_bytes / 2;
    }
#endif
  } else {
    resident_ = placement == Placement::resident;
  }
  if (resident_) {
    images_ = images.to(device).contiguous();
  } else {
    images_ = device.is_cuda() ? images.contiguous().pin_memory() : images.contiguous();
  }
}

BatchLoader::~BatchLoader() {
  if (prefetch_.valid()) prefetch_.wait();
}

void BatchLoader::start_epoch(int64_t epoch, int64_t skip) {
  if (prefetch_.valid()) prefetch_.wait();
  prefetch_ = {};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003ull + static_cast<uint64_t>(epoch));
  order_ = at::randperm(images_.size(0), gen, torch::kLong).to(images_.device());
  cursor_ = std::min(skip, batches_per_epoch_);
  if (!resident_ && cursor_ < batches_per_epoch_) {
    const int64_t batch = cursor_;
    prefetch_ = std::async(std::launch::async, [this, batch] { return gather_host(batch); });
  }
}

torch::Tensor BatchLoader::gather_host(int64_t batch) const {
  auto index = order_.slice(0, batch * batch_size_, (batch + 1) * batch_size_);
  if (!device_.is_cuda()) return images_.index_select(0, index);
  auto pinned = torch::empty({batch_size_, images_.size(1), images_.size(2), images_.size(3)},
                             torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  return torch::index_select_out(pinned, images_, 0, index);
}

torch::Tensor BatchLoader::next() {
  if (cursor_ >= batches_per_epoch_) return {};
  const int64_t batch = cursor_++;
  if (resident_) {
    return normalise(images_.index_select(0, order_.slice(0, batch * batch_size_, (batch + 1) * batch_size_)));
  }
  auto host = prefetch_.get();
  if (cursor_ < batches_per_epoch_) {
    const int64_t ahead = cursor_;
    prefetch_ = std::async(std::launch::async, [this, ahead] { return gather_host(ahead); });
  }
  // The caching host allocator keeps `host` alive until the asynchronous copy has finished.
  return normalise(host.to(device_, /*non_blocking=*/true));
}

std::string default_fashion_mnist_dir() {
  const char* dir = std::getenv("HIERPAR_DATA_DIR");
  return dir && *dir ? dir : kFashionMnistDir;
}

}  // namespace hierpar::examples
