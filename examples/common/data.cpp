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

namespace {
// The MNIST file layout (Fashion-MNIST's too): images and labels of one split, checked against each other.
Dataset load_mnist_layout(const std::string& dir, bool train, int64_t max_items, const char* name) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  auto images = read_idx_gz(prefix + "-images-idx3-ubyte.gz", 3, max_items);
  auto labels = read_idx_gz(prefix + "-labels-idx1-ubyte.gz", 1, max_items);
  if (images.size(0) != labels.size(0))
    throw Error(prefix + "-*: " + std::to_string(images.size(0)) + " images but " + std::to_string(labels.size(0)) +
                " labels");
  if (labels.max().item<int64_t>() > 9) throw Error(prefix + "-labels-idx1-ubyte.gz: a label is not in 0..9");
  std::ostringstream desc;
  desc << name << " " << (train ? "train" : "test") << " (" << images.size(0) << " images, 1x" << images.size(1) << "x"
       << images.size(2) << ", " << dir << ")";
  return {images.unsqueeze(1), labels.to(torch::kLong), desc.str()};
}
}  // namespace

Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t max_items) {
  return load_mnist_layout(dir, train, max_items, "Fashion-MNIST");
}

Dataset load_mnist(const std::string& dir, bool train, int64_t max_items) {
  return load_mnist_layout(dir, train, max_items, "MNIST");
}

ImageFiles::ImageFiles(const std::string& dir, int64_t channels, int64_t size, int64_t limit)
    : dir_(dir), channels_(channels), size_(size) {
  if (!fs::is_directory(dir)) throw Error(dir + ": not a directory (--data takes fashion-mnist, mnist, synthetic or a folder of images)");
  if (size < 1) throw Error("image folder: size must be at least 1, got " + std::to_string(size));
  if (channels != 1 && channels != 3) throw Error("image folder: channels must be 1 or 3, got " + std::to_string(channels));
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink)) {
    const auto ext = lower(entry.path().extension().string());
    if (entry.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg")) files.push_back(entry.path());
  }
  if (files.empty()) throw Error(dir + ": no .png, .jpg or .jpeg images in this folder or below it");
  std::sort(files.begin(), files.end());
  if (limit > 0 && static_cast<int64_t>(files.size()) > limit) files.resize(static_cast<size_t>(limit));
  for (const auto& f : files) files_.push_back(f.string());
}

std::string ImageFiles::description() const {
  std::ostringstream desc;
  desc << "image folder " << dir_ << " (" << count() << " images, centre squares resized to " << channels_ << "x"
       << size_ << "x" << size_ << ")";
  return desc.str();
}

void ImageFiles::decode(const torch::Tensor& indices, torch::Tensor& out) const {
  const int64_t n = indices.numel();
  TORCH_CHECK(out.dim() == 4 && out.size(0) == n && out.size(1) == channels_ && out.size(2) == size_ &&
                  out.size(3) == size_ && out.scalar_type() == torch::kUInt8,
              "ImageFiles::decode: out must be uint8 [", n, ", ", channels_, ", ", size_, ", ", size_, "]");
  const auto index = indices.to(torch::kLong).contiguous();
  const int64_t* which = index.data_ptr<int64_t>();
  // Failures are kept per image, and the first is reported.
  std::vector<std::string> errors(static_cast<size_t>(n));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      TORCH_CHECK(which[i] >= 0 && which[i] < count(), "ImageFiles::decode: index ", which[i], " out of range");
      const std::string& path = files_[static_cast<size_t>(which[i])];
      int w = 0, h = 0, found = 0;
      std::unique_ptr<stbi_uc, void (*)(void*)> pixels(stbi_load(path.c_str(), &w, &h, &found, static_cast<int>(channels_)),
                                                       stbi_image_free);
      if (!pixels) {
        errors[static_cast<size_t>(i)] = path + ": cannot read image (" + stbi_failure_reason() + ")";
        continue;
      }
      // stb gives interleaved HWC; the centred square is what a DCGAN trains on (CelebA's 178x218, for one).
      const int side = std::min(w, h);
      const auto square = torch::from_blob(pixels.get(), {h, w, channels_}, torch::kUInt8)
                              .narrow(0, (h - side) / 2, side)
                              .narrow(1, (w - side) / 2, side)
                              .permute({2, 0, 1})
                              .unsqueeze(0)
                              .contiguous();
      out[i].copy_(prepare_images(square, size_, channels_)[0]);
    }
  });
  for (const auto& error : errors) {
    if (!error.empty()) throw Error(error);
  }
}

Dataset load_image_folder(const std::string& dir, int64_t channels, int64_t size) {
  const ImageFiles files(dir, channels, size);
  auto images = torch::empty({files.count(), channels, size, size}, torch::kUInt8);
  files.decode(torch::arange(files.count(), torch::kLong), images);
  return {images, torch::Tensor(), files.description()};
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
  if (name == "files") return BatchLoader::Placement::files;
  throw FlagError("--data-placement: expected auto, device, stream or files, got '" + name + "'");
}

BatchLoader::BatchLoader(torch::Tensor images, torch::Device device, int64_t batch_size, Placement placement,
                         uint64_t seed)
    : device_(device), batch_size_(batch_size), seed_(seed) {
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == torch::kUInt8, "BatchLoader: expected uint8 [N, C, H, W]");
  TORCH_CHECK(placement != Placement::files, "BatchLoader: placement files takes ImageFiles, not a tensor");
  set_batches(images.size(0));
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

BatchLoader::BatchLoader(std::shared_ptr<const ImageFiles> files, torch::Device device, int64_t batch_size,
                         uint64_t seed, int64_t prefetch)
    : files_(std::move(files)), device_(device), batch_size_(batch_size), prefetch_depth_(prefetch), seed_(seed) {
  TORCH_CHECK(files_ != nullptr, "BatchLoader: no image files");
  if (prefetch < 1) throw Error("prefetch must be at least 1 batch, got " + std::to_string(prefetch));
  set_batches(files_->count());
}

void BatchLoader::set_batches(int64_t count) {
  if (batch_size_ < 1) throw Error("batch size must be at least 1, got " + std::to_string(batch_size_));
  if (count < batch_size_)
    throw Error("the data set has " + std::to_string(count) + " images, fewer than one batch of " +
                std::to_string(batch_size_));
  count_ = count;
  batches_per_epoch_ = count / batch_size_;
}

BatchLoader::~BatchLoader() {
  for (auto& f : prefetch_) {
    if (f.valid()) f.wait();
  }
}

void BatchLoader::start_epoch(int64_t epoch, int64_t skip) {
  for (auto& f : prefetch_) {
    if (f.valid()) f.wait();
  }
  prefetch_.clear();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003ull + static_cast<uint64_t>(epoch));
  order_ = at::randperm(count_, gen, torch::kLong);
  if (images_.defined()) order_ = order_.to(images_.device());
  cursor_ = scheduled_ = std::min(skip, batches_per_epoch_);
  if (!resident_) fill_prefetch();
}

// Up to `prefetch_depth_` batches gathered ahead, each by a task of its own.
void BatchLoader::fill_prefetch() {
  while (scheduled_ < batches_per_epoch_ && static_cast<int64_t>(prefetch_.size()) < prefetch_depth_) {
    const int64_t batch = scheduled_++;
    prefetch_.push_back(std::async(std::launch::async, [this, batch] { return gather_host(batch); }));
  }
}

torch::Tensor BatchLoader::gather_host(int64_t batch) const {
  auto index = order_.slice(0, batch * batch_size_, (batch + 1) * batch_size_);
  const int64_t channels = files_ ? files_->channels() : images_.size(1);
  const int64_t h = files_ ? files_->size() : images_.size(2), w = files_ ? files_->size() : images_.size(3);
  auto host = torch::empty({batch_size_, channels, h, w},
                           torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(device_.is_cuda()));
  if (files_) {
    files_->decode(index, host);
    return host;
  }
  return torch::index_select_out(host, images_, 0, index);
}

torch::Tensor BatchLoader::next() {
  if (cursor_ >= batches_per_epoch_) return {};
  const int64_t batch = cursor_++;
  if (resident_) {
    return normalise(images_.index_select(0, order_.slice(0, batch * batch_size_, (batch + 1) * batch_size_)));
  }
  std::future<torch::Tensor> gathered = std::move(prefetch_.front());
  prefetch_.pop_front();
  fill_prefetch();
  auto host = gathered.get();  // rethrows a gathering failure (an unreadable file)
  // The caching host allocator keeps `host` alive until the asynchronous copy has finished.
  return normalise(host.to(device_, /*non_blocking=*/true));
}

std::string default_mnist_dir() {
  const char* dir = std::getenv("HIERPAR_MNIST_DIR");
  return dir && *dir ? dir : "data/MNIST/raw";
}

std::string default_fashion_mnist_dir() {
  const char* dir = std::getenv("HIERPAR_DATA_DIR");
  return dir && *dir ? dir : kFashionMnistDir;
}

}  // namespace hierpar::examples
