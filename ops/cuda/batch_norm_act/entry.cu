// The CUDA operators hierpar::batch_norm_act and hierpar::batch_norm_act_backward (batch_norm_act.cuh): after the
// checks (register_batch_norm_act's entries), the parameters in the accumulation type, then the launch (forward.cu,
// backward.cu) for the dtype, the layout (channels_last or NCHW) and the vector width the tensors allow.
#include "cuda/batch_norm_act/batch_norm_act.cuh"

namespace hierpar::detail::bn {
namespace {

// A [C] parameter as a contiguous tensor of the accumulation type: itself when it already is one.
at::Tensor as_acc(const std::optional<at::Tensor>& p, c10::ScalarType acc) {
  if (!present(p)) return at::Tensor();
  if (p->scalar_type() == acc && p->is_contiguous()) return *p;
  return p->to(acc).contiguous();
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

bool aligned16(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// The vector width for this shape: 16 bytes when the channels (channels_last) or the plane (NCHW) hold a
// whole number of vectors and every tensor is 16-byte aligned, else 1.
template <typename scalar_t>
bool use_vectors(const Geometry& g, bool channels_last, std::initializer_list<const at::Tensor*> tensors) {
  constexpr int V = 16 / sizeof(scalar_t);
  if ((channels_last ? g.c : g.l) % V != 0) return false;
  for (const at::Tensor* t : tensors) {
    if (!aligned16(*t)) return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    Geometry g, const at::Tensor& input_, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps, Act act, double slope,
    const std::optional<at::Tensor>& num_batches_tracked) {
  c10::cuda::CUDAGuard guard(input_.device());
  check_device_code(input_.get_device());
  auto layout = layout_of(input_);
  // With H*W == 1 both layouts are the row-major [N, C] matrix: address it as channels_last (coalesced).
  const bool cl = layout == c10::MemoryFormat::ChannelsLast || g.l == 1;
  at::Tensor input = input_.contiguous(layout);
  const auto acc = stats_dtype(input.scalar_type());
  at::Tensor out = new_output(input.sizes(), input.options(), layout);
  at::Tensor save_mean = new_output({g.c}, input.options().dtype(acc));
  at::Tensor save_invstd = new_output({g.c}, input.options().dtype(acc));
  if (input.numel() == 0) {  // eval with an empty batch (training rejects it): nothing to normalise
    save_mean.copy_(*running_mean);
    save_invstd.copy_(running_var->to(acc).add(eps).rsqrt());
    return {out, save_mean, save_invstd};
  }

  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor rm = as_acc(running_mean, acc), rv = as_acc(running_var, acc);
  auto stream = at::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "batch_norm_act_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    ForwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                            ptr_or_null<acc_t>(b),
                            ptr_or_null<acc_t>(rm),  // training: updated when given; eval: read
                            ptr_or_null<acc_t>(rv),
                            save_mean.data_ptr<acc_t>(),
                            save_invstd.data_ptr<acc_t>(),
                            nullptr,
                            static_cast<acc_t>(momentum),
                            static_cast<acc_t>(eps),
                            static_cast<acc_t>(slope),
                            act,
                            training,
                            training && present(num_batches_tracked) ? num_batches_tracked->data_ptr<int64_t>()
                                                                     : nullptr};
    const bool vec = use_vectors<scalar_t>(g, cl, {&input, &out});
    if (cl) {
      if (vec) launch_forward<scalar_t, acc_t, true, kVec<scalar_t>>(g, input, out, args, training, stream);
      else launch_forward<scalar_t, acc_t, true, 1>(g, input, out, args, training, stream);
    } else {
      if (vec) launch_forward<scalar_t, acc_t, false, kVec<scalar_t>>(g, input, out, args, training, stream);
      else launch_forward<scalar_t, acc_t, false, 1>(g, input, out, args, training, stream);
    }
  });

  if (training && present(running_mean)) {  // running stats kept in another dtype or not contiguous
    if (!rm.is_same(*running_mean)) running_mean->copy_(rm);
    if (!rv.is_same(*running_var)) running_var->copy_(rv);
  }
  return {out, save_mean, save_invstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    Geometry g, const at::Tensor& grad_output_, const at::Tensor& output_, const std::optional<at::Tensor>& input_,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, bool training, double eps, Act act, double slope, std::array<bool, 3> output_mask) {
  c10::cuda::CUDAGuard guard(output_.device());
  check_device_code(output_.get_device());
  auto layout = layout_of(output_);
  const bool cl = layout == c10::MemoryFormat::ChannelsLast || g.l == 1;
  at::Tensor output = output_.contiguous(layout);
  at::Tensor grad_output = grad_output_.contiguous(layout);
  at::Tensor input = present(input_) ? input_->contiguous(layout) : at::Tensor();
  const auto acc = stats_dtype(output.scalar_type());
  at::Tensor w = as_acc(weight, acc), b = as_acc(bias, acc);
  at::Tensor mean = save_mean.contiguous(), invstd = save_invstd.contiguous();

  const bool need_sums = output_mask[1] || output_mask[2] || (output_mask[0] && training);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = new_output(output.sizes(), output.options(), layout);
  // Sums land in accumulation-type [C] buffers; they are the parameter gradients when requested.
  at::Tensor sum_dy_xhat = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  at::Tensor sum_dy = need_sums ? new_output({g.c}, output.options().dtype(acc)) : at::Tensor();
  if (output.numel() == 0) {
    if (need_sums) {
      sum_dy.zero_();
      sum_dy_xhat.zero_();
    }
  } else if (need_sums || output_mask[0]) {
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, output.scalar_type(), "batch_norm_act_backward_cuda", [&] {
      using acc_t = at::acc_type<scalar_t, true>;
      BackwardArgs<acc_t> args{ptr_or_null<acc_t>(w),
                               ptr_or_null<acc_t>(b),
                               mean.data_ptr<acc_t>(),
                               invstd.data_ptr<acc_t>(),
                               ptr_or_null<acc_t>(sum_dy_xhat),
                               ptr_or_null<acc_t>(sum_dy),
                               nullptr,
                               static_cast<acc_t>(slope),
                               acc_t(1) / static_cast<acc_t>(g.reduce()),
                               act,
                               training};
      const bool vec = use_vectors<scalar_t>(g, cl, {&grad_output, &output, &input, &grad_input});
      // The four kernel paths (layout x vector width), each with and without the input.
      auto run = [&](auto cl_tag, auto v_tag) {
        constexpr bool kCL = decltype(cl_tag)::value;
        constexpr int V = decltype(v_tag)::value;
        if (input.defined()) {
          launch_backward<scalar_t, acc_t, kCL, V, true>(g, grad_output, output, input, grad_input, args, need_sums,
                                                         output_mask[0], stream);
        } else {
          launch_backward<scalar_t, acc_t, kCL, V, false>(g, grad_output, output, input, grad_input, args, need_sums,
                                                          output_mask[0], stream);
        }
      };
      using Vector = std::integral_constant<int, kVec<scalar_t>>;
      using Scalar = std::integral_constant<int, 1>;
      if (cl) {
        if (vec) run(std::true_type{}, Vector{});
        else run(std::true_type{}, Scalar{});
      } else {
        if (vec) run(std::false_type{}, Vector{});
        else run(std::false_type{}, Scalar{});
      }
    });
  }
  const auto dtypes = param_grad_dtypes(output.scalar_type(), weight, bias);
  if (output_mask[1]) grad_weight = sum_dy_xhat.scalar_type() == dtypes.weight ? sum_dy_xhat : sum_dy_xhat.to(dtypes.weight);
  if (output_mask[2]) grad_bias = sum_dy.scalar_type() == dtypes.bias ? sum_dy : sum_dy.to(dtypes.bias);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace hierpar::detail::bn

TORCH_LIBRARY_IMPL(hierpar, CUDA, m) {
  hierpar::detail::bn::register_batch_norm_act<&hierpar::detail::bn::forward_cuda, &hierpar::detail::bn::backward_cuda>(m);
}
