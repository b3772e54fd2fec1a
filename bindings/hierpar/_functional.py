"""Functional forms of hierpar's operators, with torch.nn.functional's signatures.

Each is a direct call of a torch.ops.hierpar op (whose Autograd kernel differentiates it through the
registered backward op), written so TorchScript compiles it: BroadcastingList2 lets an int stand for a pair
as in torch.nn.functional.
"""

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch import _jit_internal
from torch._jit_internal import BroadcastingList2


def _pair(value: BroadcastingList2[int]) -> List[int]:
    # TorchScript has already broadcast an int to a list here; eager Python may pass an int or a tuple.
    if isinstance(value, int):
        return [value, value]
    return list(value)


def _default_stride(stride: Optional[BroadcastingList2[int]]) -> List[int]:
    # The ops' schema spells "stride = kernel_size" as an empty list, like ATen's max_pool2d.
    if stride is None:
        return torch.jit.annotate(List[int], [])
    return _pair(stride)


def _max_pool2d(
    input: Tensor,
    kernel_size: BroadcastingList2[int],
    stride: Optional[BroadcastingList2[int]] = None,
    padding: BroadcastingList2[int] = 0,
    dilation: BroadcastingList2[int] = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Tensor:
    return torch.ops.hierpar.max_pool2d(
        input, _pair(kernel_size), _default_stride(stride), _pair(padding), _pair(dilation), ceil_mode
    )[0]


def max_pool2d_with_indices(
    input: Tensor,
    kernel_size: BroadcastingList2[int],
    stride: Optional[BroadcastingList2[int]] = None,
    padding: BroadcastingList2[int] = 0,
    dilation: BroadcastingList2[int] = 1,
    ceil_mode: bool = False,
    return_indices: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Like torch.nn.functional.max_pool2d_with_indices: the indices are int64 offsets into each input plane
    (H * W), usable with max_unpool2d. hierpar's op keeps a uint8 offset inside the window instead; this
    converts it, at the cost of a few elementwise ops."""
    kernel = _pair(kernel_size)
    stride_ = _default_stride(stride)
    if len(stride_) == 0:
        stride_ = kernel
    padding_ = _pair(padding)
    dilation_ = _pair(dilation)
    output, window_offset = torch.ops.hierpar.max_pool2d(input, kernel, stride_, padding_, dilation_, ceil_mode)
    tap = window_offset.long()
    out_h, out_w = window_offset.shape[-2], window_offset.shape[-1]
    rows = torch.arange(out_h, device=input.device) * stride_[0] - padding_[0]
    cols = torch.arange(out_w, device=input.device) * stride_[1] - padding_[1]
    ih = rows.view(-1, 1) + torch.div(tap, kernel[1], rounding_mode="floor") * dilation_[0]
    iw = cols + torch.remainder(tap, kernel[1]) * dilation_[1]
    return output, ih * input.shape[-1] + iw


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """Like torch.nn.functional.max_pool2d (3-d or 4-d input), on hierpar::max_pool2d. With return_indices=True
    also returns torch's int64 indices (see max_pool2d_with_indices)."""
    if return_indices:
        return max_pool2d_with_indices(input, kernel_size, stride, padding, dilation, ceil_mode)
    return _max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode)


# The return type depends on return_indices, which TorchScript cannot express: like torch.nn.functional's
# max_pool2d, TorchScript compiles the variant that return_indices (a module constant) selects, found in this
# registry. (torch._jit_internal.boolean_dispatch would build the same function and entry, but its wrapper lives
# in torch's sources, which torch.compile does not trace into: a graph break.)
_jit_internal.boolean_dispatched[max_pool2d] = {
    "if_true": max_pool2d_with_indices,
    "if_false": _max_pool2d,
    "index": 6,
    "default": False,
    "arg_name": "return_indices",
}


def batch_norm_act(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "identity",
    negative_slope: float = 0.01,
    num_batches_tracked: Optional[Tensor] = None,
) -> Tensor:
    """torch.nn.functional.batch_norm followed by an activation ("identity", "relu" or "leaky_relu" with
    negative_slope > 0), fused in one hierpar::batch_norm_act. In training mode the running statistics, when
    given, are updated in place with `momentum`, as torch's are, and num_batches_tracked (an int64 scalar), when
    given, gets 1 added by the same kernel."""
    return torch.ops.hierpar.batch_norm_act(
        input, weight, bias, running_mean, running_var, training, momentum, eps, activation, negative_slope,
        num_batches_tracked
    )[0]


def conv_transpose2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: BroadcastingList2[int] = 1,
    padding: BroadcastingList2[int] = 0,
    output_padding: BroadcastingList2[int] = 0,
    groups: int = 1,
    dilation: BroadcastingList2[int] = 1,
) -> Tensor:
    """Like torch.nn.functional.conv_transpose2d (weight [C_in, C_out/groups, kH, kW]), on
    hierpar::conv_transpose2d."""
    return torch.ops.hierpar.conv_transpose2d(
        input, weight, bias, _pair(stride), _pair(padding), _pair(output_padding), groups, _pair(dilation)
    )


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: BroadcastingList2[int] = 1,
    padding: Union[str, List[int], int] = 0,
    dilation: BroadcastingList2[int] = 1,
    groups: int = 1,
    leaky_relu_slope: Optional[float] = None,
) -> Tensor:
    """Like torch.nn.functional.conv2d (weight [C_out, C_in/groups, kH, kW]; padding an int, a pair, "same" or
    "valid"), on hierpar::conv2d: the transposed convolution's kernels run backwards, fastest for few input channels.
    With leaky_relu_slope (>= 0) the output is leaky_relu(conv2d(...), leaky_relu_slope), fused."""
    stride_ = _pair(stride)
    dilation_ = _pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            padding_ = [0, 0]
        elif padding == "same":
            if stride_[0] != 1 or stride_[1] != 1:
                raise ValueError("padding='same' is not supported for strided convolutions")
            # torch's rule: half the window on each side, the odd element of an even window at the bottom/right.
            total_h = dilation_[0] * (weight.shape[-2] - 1)
            total_w = dilation_[1] * (weight.shape[-1] - 1)
            padding_ = [total_h // 2, total_w // 2]
            if total_h % 2 != 0 or total_w % 2 != 0:
                input = torch.nn.functional.pad(input, [0, total_w % 2, 0, total_h % 2])
        else:
            raise ValueError("padding: expected an int, a pair, 'same' or 'valid', got '" + padding + "'")
    elif isinstance(padding, int):
        padding_ = [padding, padding]
    else:
        padding_ = list(padding)
    return torch.ops.hierpar.conv2d(input, weight, bias, stride_, padding_, dilation_, groups, leaky_relu_slope)
