"""Drop-in replacements for torch.nn.MaxPool2d, BatchNorm2d, ConvTranspose2d and Conv2d, and BatchNormAct2d (BatchNorm2d
with the following ReLU/LeakyReLU fused in), on torch.ops.hierpar.

Each is a subclass of the torch.nn class (BatchNormAct2d: of torch.nn's batch-norm base) that replaces only
forward: the constructor arguments, initialisation, parameters, buffers (num_batches_tracked included), state_dict
keys, repr and TorchScript-ability are torch.nn's, so checkpoints and optimisers interchange with the stock
layers. Gradients come from the ops' Autograd kernels (the registered backward ops).
"""

from typing import List, Optional

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ._functional import batch_norm_act, conv2d, conv_transpose2d, max_pool2d

__all__ = ["MaxPool2d", "BatchNorm2d", "BatchNormAct2d", "ConvTranspose2d", "Conv2d"]

_ACTIVATIONS = ("identity", "relu", "leaky_relu")


class MaxPool2d(torch.nn.MaxPool2d):
    """torch.nn.MaxPool2d on hierpar::max_pool2d. With return_indices=True the indices are torch's (int64
    offsets into each input plane, for MaxUnpool2d)."""

    def forward(self, input: Tensor):
        return max_pool2d(
            input,
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
            return_indices=self.return_indices,
        )


class _BatchNormActForward(_BatchNorm):
    """torch.nn's batch-norm forward (momentum=None: cumulative average; eval without running statistics:
    batch statistics) on hierpar::batch_norm_act with self.activation fused in."""

    activation: str
    negative_slope: float

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        average_factor = 0.0 if self.momentum is None else self.momentum
        # The op's kernel counts the batch, unless the count is needed here first (cumulative average) or the
        # buffer is not an int64 scalar on the input's device.
        counter: Optional[Tensor] = None
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                tracked = self.num_batches_tracked
                counted = tracked.dtype == torch.int64 and tracked.device == input.device
                if self.momentum is None or not counted:
                    self.num_batches_tracked.add_(1)
                    if self.momentum is None:
                        average_factor = 1.0 / float(self.num_batches_tracked)
                else:
                    counter = self.num_batches_tracked
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Training without tracking passes no running statistics (none are updated), like torch.
        pass_running_stats = not self.training or self.track_running_stats
        return batch_norm_act(
            input,
            self.running_mean if pass_running_stats else None,
            self.running_var if pass_running_stats else None,
            self.weight,
            self.bias,
            use_batch_stats,
            average_factor,
            self.eps,
            self.activation,
            self.negative_slope,
            counter,
        )


class BatchNorm2d(_BatchNormActForward, torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d on hierpar::batch_norm_act (no activation)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.activation = "identity"
        self.negative_slope = 0.01


class BatchNormAct2d(_BatchNormActForward):
    """BatchNorm2d followed by an activation in one op: activation "relu" (default), "leaky_relu" (with
    negative_slope > 0) or "identity". Same parameters, buffers and state_dict keys as torch.nn.BatchNorm2d, so
    a BatchNorm2d + ReLU pair's weights load into it."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, activation: str = "relu",
                 negative_slope: float = 0.01) -> None:
        if activation not in _ACTIVATIONS:
            raise ValueError(f"BatchNormAct2d: activation must be one of {_ACTIVATIONS}, got {activation!r}")
        if activation == "leaky_relu" and not negative_slope > 0:
            raise ValueError(
                f"BatchNormAct2d: negative_slope must be > 0 (the backward inverts the activation), got {negative_slope}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.activation = activation
        self.negative_slope = float(negative_slope)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.activation == "leaky_relu" else ""
        return f"{super().extra_repr()}, activation={self.activation}{slope}"


class ConvTranspose2d(torch.nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d on hierpar::conv_transpose2d (padding_mode "zeros" only, as torch's). On a GPU each
    call takes hierpar's kernels where the routing table (hierpar::conv_transpose2d_on_hierpar, the C++ layers'
    table) says they beat cuDNN, and torch's conv_transpose2d elsewhere."""

    def forward(self, input: Tensor, output_size: Optional[List[int]] = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("Only `zeros` padding mode is supported for ConvTranspose2d")
        assert isinstance(self.padding, tuple)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation)
        if input.is_cuda and not torch.ops.hierpar.conv_transpose2d_on_hierpar(
                input, self.weight, [self.stride[0], self.stride[1]], [self.padding[0], self.padding[1]],
                output_padding, self.groups, [self.dilation[0], self.dilation[1]]):
            return torch.nn.functional.conv_transpose2d(
                input, self.weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation)
        return conv_transpose2d(
            input, self.weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation)


class Conv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d on hierpar::conv2d, which runs the transposed convolution's kernels backwards: it beats cuDNN
    for few input channels (a discriminator's RGB layer) in bf16/fp16 on the GPU, and is slower for wide layers
    (docs/conv2d.md). On a GPU each call routes as the C++ layer does (hierpar::conv2d_on_hierpar): torch's conv2d
    where cuDNN wins. forward_with_leaky_relu fuses the activation that follows it."""

    def forward(self, input: Tensor) -> Tensor:
        return self.forward_with_leaky_relu(input, None)

    def forward_with_leaky_relu(self, input: Tensor, negative_slope: Optional[float]) -> Tensor:
        # String padding ("same", "valid") and non-zero padding modes pad the input first, as torch.nn.Conv2d does
        # for its padding modes; the op then runs without padding.
        padding = self.padding
        if isinstance(padding, str) or self.padding_mode != "zeros":
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            input = torch.nn.functional.pad(input, self._reversed_padding_repeated_twice, mode=mode)
            pads = [0, 0]
        else:
            pads = [padding[0], padding[1]]
        # On a GPU, torch's conv2d where the routing table (the C++ layers') gives the call to cuDNN.
        if input.is_cuda and not torch.ops.hierpar.conv2d_on_hierpar(
                input, self.weight, [self.stride[0], self.stride[1]], pads,
                [self.dilation[0], self.dilation[1]], self.groups):
            output = torch.nn.functional.conv2d(input, self.weight, self.bias, self.stride, pads, self.dilation,
                                                self.groups)
            return output if negative_slope is None else torch.nn.functional.leaky_relu(output, negative_slope)
        return conv2d(input, self.weight, self.bias, self.stride, pads, self.dilation, self.groups, negative_slope)
