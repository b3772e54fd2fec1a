// The entry points of the k4s2p1 fast path (conv_transpose_k4s2p1.h): whether it applies, and the forward and
// backward, which set up each GEMM (k4s2p1.cuh), plan its K splits, pack the forward weight where it is not read
// in place, and route it to the kernel family whose predicate holds: wgmma_all_phases.cu /
// wgmma_grad_input_patch.cu, else wgmma_tiles.cu, else implicit_gemm.cu (mma.sync).
#include "cuda/k4s2p1/k4s2p1.cuh"
#include "cuda/permute_copy.h"

#include <array>

namespace hierpar::detail {
namespace k4s2p1 {
namespace {

// Splits K when the output tiles alone cannot fill the GPU (two CTAs per SM), into as many splits as still fit
// in one wave (a wave and a few CTAs would cost two waves: 256->128 grad_weight had 9 x 32 CTAs on 264 slots),
// keeping >= 4 K-tiles (256 16-bit / 128 fp32 elements of K) per split (each split adds one fp32 atomic per
// output element). Grids of half a wave or more are not split (a split costs a zeroed workspace and atomics).
// fp32 plans for one CTA per SM: half the splits, so half the fp32 atomics and zeroed bytes of the split passes
// (batch 64 channels_last, forward + backward in a CUDA graph: 256->128 46.3 us against 54.6 planned for two,
// 128->64 48.2 against 55.3; NCHW 84.9 against 116.9, 92.2 against 121.5); 16-bit keeps two (bf16 batch 1024's
// grad_weight with half the CTAs: 256->128 164 us against 127). HIERPAR_K4S2P1_SPLIT_TARGET=n plans for n CTAs per SM instead (same-process timings).
// Sets a.splits / a.ktiles_per_split and returns whether the result must be accumulated atomically.
template <typename scalar_t>
bool plan_splits(GemmArgs& a, int phases, bool always_split) {
  constexpr int BK = 128 / int(sizeof(scalar_t));
  const int bn = pick_mma_bn(a.N);
  const int64_t tiles = int64_t((a.M + 127) / 128) * ((a.N + bn - 1) / bn) * phases;
  const int ktiles = (a.K + BK - 1) / BK;
  const std::optional<int64_t> planned_per_sm = knob(Knob::k4s2p1_split_target);
  const DeviceCaps& caps = current_device_caps();
  // Never more CTAs per SM than its shared memory holds (one 128-wide tile per SM on an A100).
  const int per_sm = std::max(1, std::min(planned_per_sm                    ? static_cast<int>(*planned_per_sm)
                                          : std::is_same_v<scalar_t, float> ? 1
                                                                            : 2,
                                          caps.smem_per_multiprocessor / mma_tile_smem(bn)));
  const int64_t target = per_sm * int64_t(caps.multiprocessors);
  int splits = 1;
  if (2 * tiles <= target || always_split)
    splits = int(std::max<int64_t>(1, std::min<int64_t>(target / tiles, std::max(1, ktiles / 4))));
  splits = std::min(splits, 65535 / phases);
  a.ktiles_per_split = (ktiles + splits - 1) / splits;
  a.splits = std::max(1, (ktiles + a.ktiles_per_split - 1) / a.ktiles_per_split);
  return always_split || a.splits > 1;
}

// Zeroes a dense tensor (split-K accumulation target) with one memset, no ATen op.
void zero_dense(const at::Tensor& t) {
  C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.numel() * t.element_size(), at::cuda::getCurrentCUDAStream()));
}

// Forward weight per phase: packed[py, px][ty, tx, ci][co] = w[ci, co, 1 - py + 2ty, 1 - px + 2tx] for the
// mma.sync kernel ([K, N]), or packed[py, px][co][ty, tx, ci] when k_major (the wgmma kernel's [N, K]).
template <typename scalar_t>
__global__ void pack_forward_weight_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t s2,
                                           int64_t s3, int cin, int cout, bool k_major,
                                           scalar_t* __restrict__ packed) {
  const int total = 16 * cin * cout;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
    int co, ci, tap, phase;
    if (k_major) {
      ci = i % cin;
      const int r = i / cin;
      tap = r % 4;
      co = (r / 4) % cout;
      phase = r / (4 * cout);
    } else {
      co = i % cout;
      const int r = i / cout;
      ci = r % cin;
      tap = (r / cin) % 4;
      phase = r / (4 * cin);
    }
    const int ky = 1 - (phase >> 1) + 2 * (tap >> 1), kx = 1 - (phase & 1) + 2 * (tap & 1);
    packed[i] = w[ci * s0 + co * s1 + ky * s2 + kx * s3];
  }
}

// Whether the forward reads B straight from the weight (GemmArgs' b_ld / b_sky / b_skx) instead of a packed copy:
// C_out innermost (a channels_last weight) with 16-byte-aligned rows, and K-tiles that lie in one tap (C_in a
// multiple of the K-tile); on wgmma also whole 64-column blocks (C_out > 32). The pack kernel this spares runs
// before the GEMM on the same stream (256->128: 5 us at batch 1024 bf16, 3.9 us at batch 64 fp32).
// HIERPAR_K4S2P1_WEIGHT_IN_PLACE=0 packs as before (same-process timings; also fp32 grad_input's weight copy).
// Plans the K splits of a GEMM over `phases` phases (plan_splits) whose output is `out` [batch, channels, h, w],
// dense in channels_last or NCHW, and sets that output. With splits, fp32 adds them straight into `out` (zeroed
// here) by atomics; other dtypes into a zeroed fp32 channels_last workspace, returned, which the caller copies into
// `out` after the launch (permute_copy_).
template <typename scalar_t>
at::Tensor plan_dense_output(GemmArgs& a, int phases, const at::Tensor& out, int64_t batch, int channels, int64_t h,
                             int64_t w, bool channels_last) {
  const bool split = plan_splits<scalar_t>(a, phases, false);
  if (split && std::is_same_v<scalar_t, float>) {
    zero_dense(out);
    set_output<scalar_t>(a, out.data_ptr(), dense_strides(channels, h, w, channels_last), true);
    return at::Tensor();
  }
  if (split) {
    at::Tensor ws = at::empty({batch, channels, h, w}, out.options().dtype(at::kFloat), at::MemoryFormat::ChannelsLast);
    zero_dense(ws);
    set_output<scalar_t>(a, ws.data_ptr<float>(), dense_strides(channels, h, w, true), true);
    return ws;
  }
  set_output<scalar_t>(a, out.mutable_data_ptr<scalar_t>(), dense_strides(channels, h, w, channels_last), false);
  return at::Tensor();
}

bool weight_in_place_enabled() { return switch_on(Switch::k4s2p1_weight_in_place); }

template <typename scalar_t>
bool forward_weight_in_place(const at::Tensor& weight, int cin, int cout, bool wgmma) {
  constexpr int VEC = 16 / int(sizeof(scalar_t)), BK = 128 / int(sizeof(scalar_t));
  return weight_in_place_enabled() && weight.stride(1) == 1 && cout % VEC == 0 && cin % BK == 0 &&
         weight.stride(0) % VEC == 0 && weight.stride(2) % VEC == 0 && weight.stride(3) % VEC == 0 &&
         aligned16(weight.const_data_ptr()) && (!wgmma || pick_bn(cout) >= 64);
}

// Calls f(scalar_t{}) for the fast path's dtypes.
template <typename F>
void dispatch_fast(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, "conv_transpose2d: the k4s2p1 fast path has no ", dtype, " kernel");
  }
}

}  // namespace
}  // namespace k4s2p1

using namespace k4s2p1;

bool k4s2p1_fast_path_applies(const ConvTranspose2dGeometry& g, at::ScalarType dtype) {
  const bool shape = g.kernel_h == 4 && g.kernel_w == 4 && g.stride_h == 2 && g.stride_w == 2 && g.pad_h == 1 &&
                     g.pad_w == 1 && g.dilation_h == 1 && g.dilation_w == 1 && g.groups == 1 &&
                     g.out_h == 2 * g.in_h && g.out_w == 2 * g.in_w;
  // C_out < 16: the forward's GEMM N is under one 16-wide tile and the general path measured faster
  // (32->3 at batch 1024 bf16: 1035 us general vs 1881 us here; batch 64 fp32: 116 vs 213 us).
  if (!shape || g.out_channels < 16) return false;
  // mma.sync and cp.async (code for sm_80+), and room for the 64-wide tiles.
  const DeviceCaps& caps = current_device_caps();
  if (!caps.ampere_instructions() || caps.max_smem_per_block < mma_tile_smem<64>()) return false;
  // 32-bit element indices within a tensor (offsets are 64-bit, pixel and channel counts are int).
  const int64_t biggest = std::max(g.in_pixels() * g.in_channels, g.in_pixels() * 4 * g.out_channels);
  if (biggest >= INT_MAX || 16 * std::max(g.in_channels, g.out_channels) >= INT_MAX) return false;
  if (dtype == at::kFloat) return at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
  return dtype == at::kBFloat16 || dtype == at::kHalf;
}

void k4s2p1_forward(const ConvTranspose2dGeometry& g, const at::Tensor& input4, const at::Tensor& weight,
                    const at::Tensor& out, bool out_channels_last) {
  c10::cuda::CUDAGuard device_guard(input4.device());
  const at::Tensor x = contiguous_as(input4, at::MemoryFormat::ChannelsLast);
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if (wgmma_all_phases_applies<scalar_t>(g, x, out, out_channels_last)) {
      launch_wgmma_all_phases<scalar_t>(g, x, weight, out);
    } else {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      auto stream = at::cuda::getCurrentCUDAStream();

      GemmArgs a = input_pixel_gemm<scalar_t>(g, x);
      a.M = int(g.in_pixels());
      a.N = cout;
      a.K = 4 * cin;
      a.taps_w = 2;
      a.taps_shift = 1;
      a.ntaps = 4;
      a.src_scale = 1;
      a.src_off = 0;  // + phase
      a.src_dir = -1;
      a.b_vec = cout % VEC == 0;
      a.dst_scale = 2;
      const at::Tensor ws =
          plan_dense_output<scalar_t>(a, 4, out, g.batch, cout, g.out_h, g.out_w, out_channels_last);
      const bool wgmma = wgmma_applies<scalar_t>(a);
      at::Tensor packed;
      if (forward_weight_in_place<scalar_t>(weight, cin, cout, wgmma)) {
        a.b = weight.const_data_ptr<scalar_t>();
        a.b_phase_stride = 0;
        a.b_ld = weight.stride(0);
        a.b_sky = weight.stride(2);
        a.b_skx = weight.stride(3);
        a.b_rows_per_tap = cin;
      } else {
        packed = at::empty({4, 4 * cin, cout}, weight.options());
        a.b = packed.const_data_ptr<scalar_t>();
        a.b_phase_stride = int64_t(4) * cin * cout;
        a.b_ld = cout;
        a.b_rows_per_tap = 4 * cin;
        const int total = 16 * cin * cout;
        pack_forward_weight_kernel<scalar_t><<<std::min((total + 255) / 256, 1024), 256, 0, stream>>>(
            weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1), weight.stride(2), weight.stride(3),
            cin, cout, wgmma, packed.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (wgmma)
        launch_wgmma<scalar_t>(a, 4, !packed.defined());
      else
        launch<scalar_t, false>(a, 4);
      if (ws.defined()) permute_copy_(out, ws);
    }
  });
}

void k4s2p1_backward(const ConvTranspose2dGeometry& g, const at::Tensor& grad_output4, const at::Tensor& input4,
                     const at::Tensor& weight, const at::Tensor& grad_input, bool grad_input_channels_last,
                     const at::Tensor& grad_weight) {
  c10::cuda::CUDAGuard device_guard(grad_output4.device());
  // grad_output, and the input where grad_weight needs it, channels_last: both by one launch.
  const std::array<at::Tensor, 2> activations = contiguous_as(
      grad_output4, grad_weight.defined() ? input4 : at::Tensor(), at::MemoryFormat::ChannelsLast);
  const at::Tensor& go = activations[0];
  const int cin = int(g.in_channels), cout = int(g.out_channels);
  dispatch_fast(go.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    {
      constexpr int VEC = 16 / int(sizeof(scalar_t));
      GemmArgs common = input_pixel_gemm<scalar_t>(g, go);
      common.taps_w = 4;
      common.taps_shift = 2;
      common.ntaps = 16;
      common.src_scale = 2;
      common.src_off = -1;
      common.src_dir = 1;
      if (grad_input.defined() &&
          wgmma_grad_input_patch_applies<scalar_t>(g, go, grad_input, grad_input_channels_last)) {
        launch_wgmma_grad_input_patch<scalar_t>(g, go, weight, grad_input);
      } else if (grad_input.defined()) {
        GemmArgs a = common;
        a.M = int(g.in_pixels());
        a.N = cin;
        a.K = 16 * cout;
        a.b_phase_stride = 0;
        a.b_vec = cin % VEC == 0;
        a.dst_scale = 1;
        const at::Tensor ws =
            plan_dense_output<scalar_t>(a, 1, grad_input, g.batch, cin, g.in_h, g.in_w, grad_input_channels_last);
        // B[(ky, kx, co), ci] = w[ci, co, ky, kx] ([K, N]), or its transpose [ci][(ky, kx, co)] for wgmma and,
        // where that is the weight's own memory (channels_last), for fp32: no copy of the weight (4.9 us before
        // the 256->128 grad_input at batch 64 fp32).
        const bool wgmma = wgmma_applies<scalar_t>(a);
        const bool b_kmajor = std::is_same_v<scalar_t, float> && weight_in_place_enabled() && a.a_vec && a.b_vec &&
                              pick_bn(cin) >= 32 && weight.permute({0, 2, 3, 1}).is_contiguous() &&
                              aligned16(weight.const_data_ptr());
        const at::Tensor wt = contiguous_as(
            weight.permute(wgmma || b_kmajor ? at::IntArrayRef{0, 2, 3, 1} : at::IntArrayRef{2, 3, 1, 0}),
            at::MemoryFormat::Contiguous);
        a.b = wt.const_data_ptr<scalar_t>();
        a.b_ld = wgmma || b_kmajor ? a.K : a.N;
        a.b_rows_per_tap = a.K;
        if (wgmma)
          launch_wgmma<scalar_t>(a, 1, false);
        else
          launch<scalar_t, false>(a, 1, b_kmajor);
        if (ws.defined()) permute_copy_(grad_input, ws);
      }
      if (grad_weight.defined()) {
        const at::Tensor& x = activations[1];
        GemmArgs a = common;
        a.M = 16 * cout;
        a.N = cin;
        a.K = int(g.in_pixels());
        a.b = x.const_data_ptr<scalar_t>();
        a.b_phase_stride = 0;
        a.b_ld = cin;
        a.b_rows_per_tap = a.K;
        a.b_vec = cin % VEC == 0 && aligned16(a.b);
        plan_splits<scalar_t>(a, 1, true);
        // gw^T[(ky, kx, co), ci], accumulated in fp32 over the K splits: straight into an fp32 grad_weight
        // whose output channels are innermost (channels_last: row (ky, kx, co) at co + ky*s2 + kx*s3, column
        // ci at stride s0; the 16 rows a half-warp adds to are consecutive); on wgmma (16-bit) in an fp32
        // workspace plus one counter per output tile (one memset) that the kernel itself writes to grad_weight
        // from; else into the dense fp32 workspace [ky, kx, co, ci] (16-byte atomics along ci) and then one
        // transposing copy into grad_weight. An NCHW weight written in place puts those 16 rows 16 elements
        // apart, one sector per atomic: the 256->128 layer's grad_weight took 61 us against 17 us for the same
        // GEMM with a channels_last weight (H200).
        const bool wgmma = wgmma_wgrad_applies<scalar_t>(a);
        at::Tensor ws;
        if (std::is_same_v<scalar_t, float> && grad_weight.stride(1) == 1) {
          zero_dense(grad_weight);
          set_output<scalar_t>(a, grad_weight.data_ptr(),
                               Strides{grad_weight.stride(1), grad_weight.stride(2), grad_weight.stride(3),
                                       grad_weight.stride(0)},
                               true);
        } else if (wgmma) {
          set_output<scalar_t>(a, grad_weight.data_ptr(),
                               Strides{grad_weight.stride(1), grad_weight.stride(2), grad_weight.stride(3),
                                       grad_weight.stride(0)},
                               false);
          if (a.splits > 1) {
            ws = at::empty({int64_t(a.M) * a.N + wgmma_wgrad_tiles(a)}, go.options().dtype(at::kFloat));
            zero_dense(ws);
            a.ws = ws.data_ptr<float>();
            a.tile_done = reinterpret_cast<unsigned*>(a.ws + int64_t(a.M) * a.N);
          }
        } else {
          ws = at::empty({4, 4, g.out_channels, g.in_channels}, go.options().dtype(at::kFloat));
          zero_dense(ws);
          set_output<scalar_t>(a, ws.data_ptr<float>(), Strides{cin, int64_t(4) * cout * cin, int64_t(cout) * cin, 1},
                               true);
        }
        if (wgmma) {
          launch_wgmma_wgrad<scalar_t>(a);
        } else {
          launch<scalar_t, true>(a, 1);
          if (ws.defined()) permute_copy_(grad_weight, ws.permute({3, 2, 0, 1}));
        }
      }
    }
  });
}

}  // namespace hierpar::detail
