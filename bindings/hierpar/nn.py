"""Drop-in replacements for torch.nn.MaxPool2d, BatchNorm2d, ConvTranspose2d and Conv2d, and BatchNormAct2d (BatchNorm2d
with the following ReLU/LeakyReLU fused in), on torch.ops.hierpar.

Each is a subclass of the torch.nn class (BatchNormAct2d: of torch.nn's batch-norm base) that replaces only
forward: the constructor arguments, initialisation, parameters, buffers (num_batches_tracked included), state_dict
keys, repr and TorchScript-ability are torch.nn's, so checkpoints and optimisers interchange with the stock
layers. Gradients come from the ops' Autograd kernels (the registered backward ops).

convert(model) replaces a model's torch.nn layers of those kinds by these in place, sharing their parameters and
buffers, and fuses BatchNorm2d + ReLU/LeakyReLU pairs of a Sequential into BatchNormAct2d; ConversionReport says what
it converted, fused and left.
"""

import copy
import dataclasses
from typing import Dict, List, Literal, Optional, Tuple, overload

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ._functional import batch_norm_act, max_pool2d

__all__ = ["MaxPool2d", "BatchNorm2d", "BatchNormAct2d", "ConvTranspose2d", "Conv2d", "convert", "ConversionReport"]

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
    """torch.nn.ConvTranspose2d on hierpar::conv_transpose2d_layer (padding_mode "zeros" only, as torch's). That op
    asks the routing table (the C++ layers' table, ops/routing.cpp) and runs hierpar's kernels where they beat cuDNN
    on a GPU and torch's convolution elsewhere; on the CPU it always runs hierpar's op. The decision is made inside
    the op, so torch.compile traces the layer without a graph break."""

    def forward(self, input: Tensor, output_size: Optional[List[int]] = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("Only `zeros` padding mode is supported for ConvTranspose2d")
        assert isinstance(self.padding, tuple)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation)
        return torch.ops.hierpar.conv_transpose2d_layer(
            input, self.weight, self.bias, [self.stride[0], self.stride[1]], [self.padding[0], self.padding[1]],
            output_padding, self.groups, [self.dilation[0], self.dilation[1]])


class Conv2d(torch.nn.Conv2d):
    """torch.nn.Conv2d on hierpar::conv2d_layer. That op asks the routing table (the C++ layers' table,
    ops/routing.cpp) and runs hierpar::conv2d, which runs the transposed convolution's kernels backwards, where it
    beats cuDNN on a GPU (few input channels, e.g. a discriminator's RGB layer, in bf16/fp16; docs/conv2d.md), and
    torch's convolution elsewhere; on the CPU it always runs hierpar's op. The decision is made inside the op, so
    torch.compile traces the layer without a graph break. forward_with_leaky_relu fuses the activation that follows
    it."""

    def forward(self, input: Tensor) -> Tensor:
        return self.forward_with_leaky_relu(input, None)

    def forward_with_leaky_relu(self, input: Tensor, negative_slope: Optional[float]) -> Tensor:
        """leaky_relu(self(input), negative_slope) (negative_slope >= 0), fused into the convolution where hierpar's
        op runs it; negative_slope None: self(input)."""
        # String padding ("same", "valid") and non-zero padding modes pad the input first, as torch.nn.Conv2d does
        # for its padding modes; the op then runs without padding.
        padding = self.padding
        if isinstance(padding, str) or self.padding_mode != "zeros":
            mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
            input = torch.nn.functional.pad(input, self._reversed_padding_repeated_twice, mode=mode)
            pads = [0, 0]
        else:
            pads = [padding[0], padding[1]]
        return torch.ops.hierpar.conv2d_layer(input, self.weight, self.bias, [self.stride[0], self.stride[1]], pads,
                                              [self.dilation[0], self.dilation[1]], self.groups, negative_slope)


# ---- convert: torch.nn layers of a model to hierpar.nn's ------------------------------------------------------

@dataclasses.dataclass
class ConversionReport:
    """What convert() did to a module tree. Names are qualified as in named_modules() ("" is the root); types are
    spelled as their users import them ("torch.nn.Conv2d", "hierpar.nn.BatchNormAct2d").

    converted: (name, from type, to type) for every layer replaced by a hierpar.nn layer.
    fused: (batch norm's name, activation's name) for every BatchNorm2d that became a BatchNormAct2d; the activation's
        slot now holds a torch.nn.Identity.
    left: (name, type, reason) for every layer left as it was although hierpar.nn has a layer of its kind, and for
        every ReLU/LeakyReLU after a BatchNorm2d that was not fused into it.
    """

    converted: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)
    fused: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    left: List[Tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        def table(rows: List[Tuple[str, ...]]) -> List[str]:
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
            return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]

        def shown(name: str) -> str:
            return name if name else "(root)"

        lines = [f"hierpar.nn.convert: {len(self.converted)} converted, {len(self.fused)} fused, {len(self.left)} left"]
        if self.converted:
            lines.append("converted:")
            lines += table([(shown(n), f, "-> " + t) for n, f, t in self.converted])
        if self.fused:
            lines.append("fused (batch norm + activation; the activation is now torch.nn.Identity):")
            lines += table([(shown(b), "+ " + a) for b, a in self.fused])
        if self.left:
            lines.append("left:")
            lines += table([(shown(n), t, r) for n, t, r in self.left])
        return "\n".join(lines)


_STOCK_TO_HIERPAR = {
    torch.nn.Conv2d: Conv2d,
    torch.nn.ConvTranspose2d: ConvTranspose2d,
    torch.nn.BatchNorm2d: BatchNorm2d,
    torch.nn.MaxPool2d: MaxPool2d,
}
_HIERPAR_LAYERS = (Conv2d, ConvTranspose2d, BatchNorm2d, BatchNormAct2d, MaxPool2d)
_OP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_OP_DEVICES = ("cpu", "cuda", "meta")
# The hook dictionaries of torch.nn.Module: a layer with hooks is left (the hooks belong to that object, and a fused
# batch norm's forward hook would see the activation's output).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
# Modules that read their input without writing it: a LeakyReLU(inplace=False) followed by one of these in a Sequential
# hands its output to nothing that modifies it in place (see _unfusable).
_READS_INPUT = (torch.nn.modules.conv._ConvNd, torch.nn.Linear, torch.nn.modules.pooling._MaxPoolNd,
                torch.nn.modules.pooling._AvgPoolNd, torch.nn.modules.pooling._AdaptiveAvgPoolNd,
                torch.nn.modules.pooling._AdaptiveMaxPoolNd, _BatchNorm, torch.nn.Flatten, torch.nn.Upsample,
                torch.nn.Dropout, torch.nn.Dropout2d, torch.nn.Tanh, torch.nn.Sigmoid)


def _type_name(cls: type) -> str:
    for prefix, namespace in (("hierpar.nn", globals()), ("torch.nn", vars(torch.nn))):
        if namespace.get(cls.__name__) is cls:
            return f"{prefix}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _hooks(module: torch.nn.Module) -> List[str]:
    return [name.strip("_") for name in _HOOK_DICTS if getattr(module, name, None)]


def _not_convertible(module: torch.nn.Module) -> Optional[str]:
    """Why a layer of one of _STOCK_TO_HIERPAR's exact types cannot become hierpar's, or None."""
    hooks = _hooks(module)
    if hooks:
        return f"has hooks ({', '.join(hooks)}): they belong to this object; convert before registering them"
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if (tensor.is_floating_point() or tensor.is_complex()) and tensor.dtype not in _OP_DTYPES:
            return f"{name} is {tensor.dtype}: hierpar's ops take float32, float64, bfloat16 and float16"
        if tensor.device.type not in _OP_DEVICES:
            return f"{name} is on {tensor.device}: hierpar's ops have CPU, CUDA and Meta kernels"
    for name in ("weight", "bias"):
        value = getattr(module, name, None)
        if name in module._parameters and value is not None and not isinstance(value, torch.nn.Parameter):
            return f"{name} is a plain tensor, not a Parameter, so it cannot be shared with a new layer"
    if isinstance(module, torch.nn.MaxPool2d):
        kernel = module.kernel_size if isinstance(module.kernel_size, tuple) else (module.kernel_size,) * 2
        if kernel[0] * kernel[1] > 256:
            return (f"kernel_size {module.kernel_size} has {kernel[0] * kernel[1]} elements per window: hierpar's "
                    "uint8 window index addresses at most 256 (e.g. 16x16)")
    return None


def _not_replaced_reason(module: torch.nn.Module) -> Optional[str]:
    """For a module that is not one of _STOCK_TO_HIERPAR's exact types: why it is reported as left (a layer of a
    kind hierpar.nn has), or None (nothing to report)."""
    if isinstance(module, _HIERPAR_LAYERS):
        return "already a hierpar.nn layer"
    if isinstance(module, torch.nn.SyncBatchNorm):
        return "SyncBatchNorm synchronises statistics across processes; hierpar's batch norm does not"
    for stock in _STOCK_TO_HIERPAR:
        if isinstance(module, stock):
            if torch.nn.utils.parametrize.is_parametrized(module):
                return (f"parametrized (torch.nn.utils.parametrize): its parameters are computed on access, which "
                        f"{_type_name(_STOCK_TO_HIERPAR[stock])} does not reproduce")
            return (f"a subclass of {_type_name(stock)}, whose forward or state may differ from the stock layer's that "
                    f"{_type_name(_STOCK_TO_HIERPAR[stock])} reproduces; replace it by hand if it is equivalent")
    return None


def _converted(module: torch.nn.Module, activation: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """The hierpar.nn layer for `module` (one of _STOCK_TO_HIERPAR's exact types, convertible) holding the same
    Parameter and buffer objects, training flag and other attributes; with `activation` (a ReLU or LeakyReLU with
    negative_slope > 0) a BatchNormAct2d with it fused in."""
    meta = dict(device="meta", dtype=None)
    if isinstance(module, torch.nn.MaxPool2d):
        new: torch.nn.Module = MaxPool2d(module.kernel_size, module.stride, module.padding, module.dilation,
                                         return_indices=module.return_indices, ceil_mode=module.ceil_mode)
    elif isinstance(module, torch.nn.BatchNorm2d):
        meta["dtype"] = module.weight.dtype if module.weight is not None else None
        args = (module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        if activation is None:
            new = BatchNorm2d(*args, **meta)
        elif isinstance(activation, torch.nn.LeakyReLU):
            new = BatchNormAct2d(*args, **meta, activation="leaky_relu", negative_slope=activation.negative_slope)
        else:
            new = BatchNormAct2d(*args, **meta, activation="relu")
    elif isinstance(module, torch.nn.ConvTranspose2d):
        meta["dtype"] = module.weight.dtype
        new = ConvTranspose2d(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                              module.padding, module.output_padding, module.groups, module.bias is not None,
                              module.dilation, module.padding_mode, **meta)
    else:
        meta["dtype"] = module.weight.dtype
        new = Conv2d(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                     module.dilation, module.groups, module.bias is not None, module.padding_mode, **meta)
    # The constructor has registered the same parameter and buffer names (on the meta device: nothing allocated);
    # the original objects replace them, so optimisers, state_dict and tied weights see no change.
    for name, param in module._parameters.items():
        setattr(new, name, param)
    for name, buffer in module._buffers.items():
        setattr(new, name, buffer)
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for name, value in vars(module).items():  # attributes a user (or a tool, e.g. qconfig) set on the layer
        if name not in vars(new):
            setattr(new, name, value)
    new.training = module.training
    return new


def _unfusable(bn: torch.nn.Module, activation: torch.nn.Module, following: Optional[torch.nn.Module]) -> Optional[str]:
    """Why BatchNorm2d `bn` (convertible) followed in a Sequential by `activation` (a ReLU or LeakyReLU of the exact
    type) and then by `following` (None: the last module) is not fused into a BatchNormAct2d, or None."""
    hooks = _hooks(activation)
    if hooks:
        return f"not fused: the activation has hooks ({', '.join(hooks)})"
    if isinstance(activation, torch.nn.LeakyReLU):
        slope = activation.negative_slope
        if not slope > 0:
            return (f"not fused: negative_slope {slope} <= 0; BatchNormAct2d's backward recovers the pre-activation "
                    "by inverting the LeakyReLU, which needs a slope > 0")
        if bn.weight is not None and bn.weight.device.type != "meta" and bool((bn.weight == 0).any()):
            return ("not fused: the batch norm's weight has zeros; BatchNormAct2d(leaky_relu) recovers xhat from its "
                    "output, which a zero weight makes impossible (that channel's grad_weight would be NaN)")
        if not activation.inplace and (following is None or not isinstance(following, _READS_INPUT) or
                                       getattr(following, "inplace", False)):
            # Stock LeakyReLU(inplace=False) keeps its input for backward, so its output may be modified in place
            # afterwards; BatchNormAct2d(leaky_relu) keeps its output, and autograd would refuse that modification.
            return ("not fused: a LeakyReLU(inplace=False) whose output goes to "
                    + ("the Sequential's caller" if following is None else f"a {_type_name(type(following))}")
                    + ", which may modify it in place; BatchNormAct2d(leaky_relu) keeps its output for backward, so "
                    "autograd would then refuse the backward where stock's LeakyReLU (keeping its input) does not")
    return None


class _Converter:
    def __init__(self, fuse_activations: bool):
        self.fuse = fuse_activations
        self.report = ConversionReport()
        self.done: Dict[int, torch.nn.Module] = {}  # id of a converted layer -> its replacement (shared layers)

    def module(self, module: torch.nn.Module, name: str) -> torch.nn.Module:
        if isinstance(module, torch.jit.ScriptModule):
            self.scripted(module, name)
            return module
        stock = _STOCK_TO_HIERPAR.get(type(module))
        if stock is not None:
            if id(module) in self.done:
                return self.done[id(module)]
            why = _not_convertible(module)
            if why is None:
                new = _converted(module)
                self.done[id(module)] = new
                self.report.converted.append((name, _type_name(type(module)), _type_name(type(new))))
                return new
            self.report.left.append((name, _type_name(type(module)), why))
        else:
            why = _not_replaced_reason(module)
            if why is not None:
                self.report.left.append((name, _type_name(type(module)), why))
        self.children(module, name)
        return module

    def children(self, module: torch.nn.Module, name: str) -> None:
        # Every slot (named_children() skips a module already seen under another name of the same parent).
        slots = [(key, child) for key, child in module._modules.items() if child is not None]
        # Fusion needs the order of execution, which only a Sequential's slots give (when its forward is torch's).
        sequential = isinstance(module, torch.nn.Sequential)
        runs_in_order = sequential and type(module).forward is torch.nn.Sequential.forward
        skip = False
        for i, (key, child) in enumerate(slots):
            if skip:
                skip = False
                continue
            qualified = f"{name}.{key}" if name else key
            following = slots[i + 1][1] if i + 1 < len(slots) else None
            if (self.fuse and sequential and type(child) is torch.nn.BatchNorm2d
                    and type(following) in (torch.nn.ReLU, torch.nn.LeakyReLU) and _not_convertible(child) is None):
                act_key, activation = slots[i + 1]
                act_name = f"{name}.{act_key}" if name else act_key
                if runs_in_order:
                    why = _unfusable(child, activation, slots[i + 2][1] if i + 2 < len(slots) else None)
                else:
                    why = ("not fused: the Sequential subclass has its own forward, which may not run its layers in "
                           "order")
                if why is None:
                    fused = _converted(child, activation)
                    identity = torch.nn.Identity()
                    identity.training = activation.training
                    module._modules[key] = fused
                    module._modules[act_key] = identity
                    self.report.converted.append((qualified, _type_name(type(child)), _type_name(type(fused))))
                    self.report.fused.append((qualified, act_name))
                    skip = True
                    continue
                self.report.left.append((act_name, _type_name(type(activation)), why))
            new = self.module(child, qualified)
            if new is not child:
                module._modules[key] = new

    def scripted(self, module: torch.jit.ScriptModule, name: str) -> None:
        for sub_name, sub in module.named_modules():
            original = getattr(sub, "original_name", type(sub).__name__)
            if original in ("Conv2d", "ConvTranspose2d", "BatchNorm2d", "MaxPool2d"):
                qualified = ".".join(n for n in (name, sub_name) if n)
                self.report.left.append((qualified, f"torch.jit.ScriptModule ({original})",
                                         "inside a TorchScript module, whose compiled code calls its own layers; "
                                         "convert before torch.jit.script / torch.jit.trace"))


@overload
def convert(module: torch.nn.Module, *, fuse_activations: bool = ..., inplace: bool = ...,
            report: Literal[False] = ...) -> torch.nn.Module: ...


@overload
def convert(module: torch.nn.Module, *, fuse_activations: bool = ..., inplace: bool = ...,
            report: Literal[True]) -> Tuple[torch.nn.Module, ConversionReport]: ...


def convert(module, *, fuse_activations=True, inplace=True, report=False):
    """Replaces the torch.nn layers of `module`'s tree that hierpar.nn has by hierpar.nn's, as
    torch.nn.SyncBatchNorm.convert_sync_batchnorm does for batch norm, and returns the converted module (a new object
    where the root itself is such a layer). With report=True returns (module, ConversionReport) instead; print the
    report for a table of what was converted, fused and left.

    Every torch.nn.Conv2d, ConvTranspose2d, BatchNorm2d and MaxPool2d (of exactly those types) becomes hierpar.nn's
    layer of the same name holding the SAME Parameter and buffer objects: an optimizer built before the conversion
    keeps updating the model, state_dict keys and values are unchanged, and device, dtype, requires_grad, the training
    flag and any extra attributes set on the layer stay. A layer referenced from several places becomes one
    hierpar layer in all of them.

    fuse_activations: inside a torch.nn.Sequential (not a subclass with its own forward), a BatchNorm2d immediately
    followed by a torch.nn.ReLU or LeakyReLU (inplace or not) becomes a BatchNormAct2d with that activation, and the
    activation's slot a torch.nn.Identity (indices and state_dict keys stay). Not fused, and reported in `left`: a
    LeakyReLU with negative_slope <= 0 (the fused backward inverts the activation); a batch norm whose weight has zeros
    before a LeakyReLU (the same inversion); an activation with hooks; a LeakyReLU(inplace=False) whose output leaves
    the Sequential or goes to a module that might modify it in place (BatchNormAct2d(leaky_relu) keeps its output for
    backward where stock's LeakyReLU keeps its input, so an in-place op on it would make autograd refuse the backward).
    A batch norm and an activation in different containers are converted but not fused.

    Left as they are, and reported with the reason: subclasses of those four classes (their forward may differ),
    parametrized layers (torch.nn.utils.parametrize), layers with hooks, parameters in dtypes or on devices hierpar's
    ops do not take, a MaxPool2d window over 256 elements, SyncBatchNorm, layers already hierpar's, and layers inside a
    torch.jit.ScriptModule (its compiled code is not changed). Layers of other kinds are neither touched nor reported.

    inplace=False converts a deep copy and leaves `module` as it was (the copy's parameters are then new objects, which
    an optimizer built for the original does not update).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"hierpar.nn.convert: module: expected a torch.nn.Module, got {type(module).__name__}")
    if not inplace:
        module = copy.deepcopy(module)
    converter = _Converter(bool(fuse_activations))
    converted = converter.module(module, "")
    return (converted, converter.report) if report else converted
