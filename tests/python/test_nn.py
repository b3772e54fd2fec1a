"""hierpar.nn's layers are drop-in replacements of torch.nn's: same constructor arguments, initialisation,
state_dict keys and, on random shapes and layouts, the same forward and gradients."""
import copy

import pytest
import torch
import torch.nn.functional as F

import hierpar
from conftest import DEVICES, random_tensor

# (rtol, atol) per dtype, hierpar against torch.nn. The two sum in different orders (batch-norm statistics,
# transposed-convolution taps), so results differ by rounding: a few units in the last place of float64 and
# float32 after sums of up to a few thousand terms; bfloat16 (8-bit mantissa) and float16 (11-bit) also
# round the output itself, one ulp being 2**-8 and 2**-11 relative.
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}
LAYOUTS = ["contiguous", "channels_last", "strided"]


def assert_close(actual, expected, what):
    rtol, atol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def magnitude_atol(stock, input, upstream_like):
    """For bfloat16/float16: each output (and gradient) element is a sum of products that either side may round
    a few times at 2**-8 (bfloat16) or 2**-11 (float16) relative to the terms, not to the sum (which cancels).
    Returns absolute tolerances from the sums of |terms|: the float64 module with |weights| on |input|, backward
    from |upstream|: (output, grad_input, [grad of each parameter])."""
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[input.dtype]
    magnitude = copy.deepcopy(stock).double()
    with torch.no_grad():
        for p in magnitude.parameters():
            p.abs_()
    x = input.detach().double().abs().requires_grad_()
    out = magnitude(x)
    out.backward(upstream_like.double().abs())
    tol = lambda t: 4 * unit * float(t.abs().max()) + 1e-6
    return tol(out), tol(x.grad), [tol(p.grad) for p in magnitude.parameters()]


def check_same_module(hp, stock, input, what, grad=True, param_grad_atol=None, input_grad_reference=None,
                      activation_flips=False):
    """Forward (and backward from the same random upstream gradient) of hp and stock on copies of input;
    compares outputs, input gradients and parameter gradients (convolutions in bfloat16/float16 against stock's
    float64 copy instead, with tolerances from magnitude_atol; param_grad_atol(upstream): an absolute tolerance
    instead of the dtype's). input_grad_reference(upstream): a float64 grad_input against which hierpar's may be off
    by the dtype's tolerance plus twice stock's own largest error. activation_flips: the modules end in a ReLU/LeakyReLU applied
    elementwise to an output of the input's shape, in a precision where the two pre-activations may round to
    opposite sides of 0; grad_input is then compared where the two outputs have the same sign (the forward
    comparison has already bounded both outputs near 0 where they do not)."""
    x_hp = input.detach().clone().requires_grad_(grad)
    x_stock = input.detach().clone().requires_grad_(grad)
    sums = isinstance(stock, (torch.nn.ConvTranspose2d, torch.nn.Conv2d)) and input.dtype in (torch.bfloat16,
                                                                                              torch.float16)
    if sums:
        # Convolutions in 16-bit types are checked against the float64 module, not against stock's own 16-bit
        # arithmetic: ATen's CPU kernels for them differ by CPU (oneDNN with AVX512-BF16/AMX or not), and on a Xeon
        # one of them was off by far more than rounding where hierpar agreed with float64 elsewhere.
        reference = copy.deepcopy(stock).double()
        x_stock = input.detach().double().requires_grad_(grad)
        stock = reference
    out_hp, out_stock = hp(x_hp), stock(x_stock)
    upstream = torch.randn_like(out_stock).to(out_hp.dtype)
    if sums:
        out_atol, input_grad_atol, param_atols = magnitude_atol(stock, input, upstream)
        torch.testing.assert_close(out_hp.double(), out_stock, rtol=0, atol=out_atol,
                                   msg=lambda m: f"{what}: output against float64: {m}")
    else:
        assert_close(out_hp, out_stock, f"{what}: output")
    if not grad:
        return
    out_hp.backward(upstream)
    out_stock.backward(upstream.to(out_stock.dtype))
    if sums:
        torch.testing.assert_close(x_hp.grad.double(), x_stock.grad, rtol=0, atol=input_grad_atol,
                                   msg=lambda m: f"{what}: grad_input against float64: {m}")
    else:
        actual, expected, which = x_hp.grad, x_stock.grad, "grad_input"
        if activation_flips:  # the activation's output has the input's shape
            same_side = (out_hp > 0) == (out_stock > 0)
            actual, expected, which = actual[same_side], expected[same_side], "grad_input (same-sign outputs)"
        if input_grad_reference is None:
            assert_close(actual, expected, f"{what}: {which}")
        elif actual.numel() > 0:
            reference = input_grad_reference(upstream)
            reference = reference[same_side] if activation_flips else reference
            rtol, atol = TOLERANCE[expected.dtype]
            stock_error = float((expected.double() - reference).abs().max())
            torch.testing.assert_close(actual.double(), reference, rtol=rtol, atol=atol + 2 * stock_error,
                                       msg=lambda m: f"{what}: {which} against float64 (stock off by {stock_error}): {m}")
    for i, ((name, p_hp), (_, p_stock)) in enumerate(zip(hp.named_parameters(), stock.named_parameters())):
        if sums:
            torch.testing.assert_close(p_hp.grad.double(), p_stock.grad, rtol=0, atol=param_atols[i],
                                       msg=lambda m: f"{what}: grad of {name} against float64: {m}")
        elif param_grad_atol is None:
            assert_close(p_hp.grad, p_stock.grad, f"{what}: grad of {name}")
        else:
            torch.testing.assert_close(p_hp.grad, p_stock.grad, rtol=0, atol=param_grad_atol(upstream),
                                       msg=lambda m: f"{what}: grad of {name}: {m}")


def check_state_dict_round_trip(hp, stock):
    assert list(hp.state_dict().keys()) == list(stock.state_dict().keys())
    for key, value in stock.state_dict().items():  # same initialisation
        torch.testing.assert_close(hp.state_dict()[key], value, rtol=0, atol=0, msg=f"initial {key}")
    changed = {k: (v + torch.rand_like(v.double()).to(v.dtype) + 1 if v.is_floating_point() else v + 3)
               for k, v in stock.state_dict().items()}
    hp.load_state_dict(changed, strict=True)
    stock_again = copy.deepcopy(stock)
    stock_again.load_state_dict(hp.state_dict(), strict=True)
    for key, value in changed.items():
        assert torch.equal(stock_again.state_dict()[key], value), key


def same_seeded_modules(hp_class, stock_class, args, seed, device, dtype):
    """hierpar's and torch's module built from `args` with the same seed: same repr, a state dict that round-trips,
    and the stock one left with hierpar's weights."""
    torch.manual_seed(seed)
    hp = hp_class(**args, device=device, dtype=dtype)
    torch.manual_seed(seed)
    stock = stock_class(**args, device=device, dtype=dtype)
    assert repr(hp).replace("hierpar.nn.", "") == repr(stock)
    check_state_dict_round_trip(hp, stock)
    stock.load_state_dict(hp.state_dict())
    return hp, stock


# ---- MaxPool2d ---------------------------------------------------------------------------------------------

def random_pool(rng):
    """Random MaxPool2d arguments, and the (height, width) an input needs at least."""
    kernel = (rng.randint(1, 4), rng.randint(1, 4))
    padding = (rng.randint(0, kernel[0] // 2), rng.randint(0, kernel[1] // 2))
    stride = None if rng.random() < 0.3 else (rng.randint(1, 3), rng.randint(1, 3))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    args = dict(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=rng.random() < 0.5)
    if rng.random() < 0.5 and kernel[0] == kernel[1] and padding[0] == padding[1]:  # the int spelling too
        args.update(kernel_size=kernel[0], padding=padding[0])
    return args, [dilation[i] * (kernel[i] - 1) + 1 for i in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_max_pool2d_matches_torch(seeded, device, dtype, layout):
    rng = seeded
    exact = dtype in (torch.float32, torch.float64)  # bfloat16/float16 inputs have ties: either index is right
    for trial in range(3):
        args, reach = random_pool(rng)
        return_indices = rng.random() < 0.5
        hp = hierpar.nn.MaxPool2d(**args, return_indices=return_indices)
        stock = torch.nn.MaxPool2d(**args, return_indices=return_indices)
        assert repr(hp) == repr(stock)
        sizes = [rng.choice([1, rng.randint(1, 4)]), rng.choice([1, rng.randint(1, 6)]),
                 rng.randint(reach[0], reach[0] + 9), rng.randint(reach[1], reach[1] + 9)]
        if rng.random() < 0.2:
            sizes = sizes[1:]  # unbatched (C, H, W)
        x = random_tensor(sizes, dtype, device, layout)
        what = f"MaxPool2d({args}, return_indices={return_indices}) on {tuple(sizes)} {dtype} {layout}"
        if return_indices:
            (out_hp, idx_hp), (out_stock, idx_stock) = hp(x), stock(x)
            assert torch.equal(out_hp, out_stock), what
            assert idx_hp.dtype == torch.int64 and idx_hp.shape == idx_stock.shape, what
            if exact:
                assert torch.equal(idx_hp, idx_stock), what
        else:
            check_same_module(hp, stock, x, what, grad=exact)


# ---- BatchNorm2d / BatchNormAct2d ------------------------------------------------------------------------

ACTIVATIONS = {
    "identity": lambda t, s: t,
    "relu": lambda t, s: F.relu(t),
    "leaky_relu": lambda t, s: F.leaky_relu(t, s),
}


class StockBatchNormAct(torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d followed by the activation: the reference for hierpar.nn.BatchNormAct2d."""

    def __init__(self, *args, activation="relu", negative_slope=0.01, **kwargs):
        super().__init__(*args, **kwargs)
        self.act = lambda t: ACTIVATIONS[activation](t, negative_slope)

    def forward(self, input):
        return self.act(super().forward(input))


def bn_pair(rng, num_features, dtype, device, activation):
    kwargs = dict(eps=rng.choice([1e-5, 1e-3]), momentum=rng.choice([0.1, 0.3, None]), affine=rng.random() < 0.8,
                  track_running_stats=rng.random() < 0.8, device=device)
    if dtype == torch.float64:
        kwargs["dtype"] = dtype  # low-precision inputs keep float32 parameters, as with autocast
    slope = rng.choice([0.01, 0.2])
    if activation == "identity" and rng.random() < 0.5:
        hp = hierpar.nn.BatchNorm2d(num_features, **kwargs)
    else:
        hp = hierpar.nn.BatchNormAct2d(num_features, **kwargs, activation=activation, negative_slope=slope)
    stock = StockBatchNormAct(num_features, **kwargs, activation=activation, negative_slope=slope)
    with torch.no_grad():  # non-trivial affine parameters and running statistics, the same in both
        if stock.affine:
            stock.weight.copy_(torch.rand_like(stock.weight) + 0.5)
            stock.bias.copy_(torch.rand_like(stock.bias) * 3 - 1.5)
        if stock.track_running_stats:
            stock.running_mean.copy_(torch.randn_like(stock.running_mean))
            stock.running_var.copy_(torch.rand_like(stock.running_var) + 0.5)
    hp.load_state_dict(stock.state_dict())
    return hp, stock, kwargs


def low_precision_bn_param_grad_atol(upstream):
    """grad_weight[c] = sum(upstream * xhat) over the channel's elements. hierpar's backward recovers xhat from
    the saved bfloat16 OUTPUT z = weight * xhat + bias (rounded to 2**-8 relative) where torch's uses the input,
    so xhat may be off by 2**-8 * |z| / |weight|: with |xhat| <= ~4, |bias| <= ~1.5 and weight in [0.5, 1.5]
    (bn_pair's draws), at most 15 * 2**-8 per unit of |upstream|. Bound the sum by that, per channel (not
    relative to the sum, which cancels)."""
    per_channel = upstream.double().abs().transpose(0, 1).flatten(1).sum(1)
    return float(per_channel.max()) * 16 * 2**-8


def float64_grad_input(stock, input):
    """upstream -> grad_input of a float64 copy of stock on input's (low-precision) values. For batch norm in
    bfloat16 the reference itself is not exact: with few elements a channel its terms cancel, and torch's own
    bfloat16 result was seen 3.7 * invstd * mean|upstream| off the float64 one (batch 1, 1 x 2 pixels)."""
    def reference(upstream):
        module = copy.deepcopy(stock).double()
        x = input.detach().double().requires_grad_()
        module(x).backward(upstream.double())
        return x.grad

    return reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_batch_norm_matches_torch(seeded, device, dtype, activation):
    rng = seeded
    for trial in range(2):
        c = rng.choice([1, rng.randint(2, 9)])
        hp, stock, kwargs = bn_pair(rng, c, dtype, device, activation)
        what = f"{type(hp).__name__}({c}, {kwargs}, {activation})"
        # bfloat16: a normalised value within rounding of 0 may land on either side in the two implementations
        # (seen: 1 element in 1728, seed 1013068638), which flips its ReLU mask.
        flips = activation != "identity" and dtype == torch.bfloat16
        for step in range(3):  # training steps: running statistics and num_batches_tracked evolve
            sizes = [rng.choice([1, 2, rng.randint(2, 6)]), c, rng.randint(1, 7), rng.randint(2, 7)]
            if dtype == torch.bfloat16 and sizes[0] * sizes[2] * sizes[3] < 4:
                # Over 2 values a channel the input gradient is exactly 0 (each output is +-1 whatever the input),
                # so a bfloat16 result is rounding noise of the size of invstd * |upstream| in either implementation
                # (seen: hierpar 0.038 and torch 3.7 * invstd * mean|upstream| from float64): 4 values at least.
                sizes[2] = 2
            x = random_tensor(sizes, dtype, device, rng.choice(LAYOUTS)) * 2 + 0.5
            low = dtype == torch.bfloat16
            check_same_module(hp, stock, x, f"{what} train step {step} on {tuple(sizes)}",
                              param_grad_atol=low_precision_bn_param_grad_atol if low else None,
                              input_grad_reference=float64_grad_input(stock, x) if low else None,
                              activation_flips=flips)
            for key, value in stock.state_dict().items():
                torch.testing.assert_close(hp.state_dict()[key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what}: {key} after step {step}: {m}")
        hp.eval(), stock.eval()
        x = random_tensor([2, c, 5, 3], dtype, device, rng.choice(LAYOUTS))
        check_same_module(hp, stock, x, f"{what} eval",
                          param_grad_atol=low_precision_bn_param_grad_atol if dtype == torch.bfloat16 else None,
                          activation_flips=flips)


def test_batch_norm_act_loads_batch_norm_weights():
    """A stock BatchNorm2d's checkpoint loads into BatchNormAct2d and BatchNorm2d (same keys, same version)."""
    stock = torch.nn.BatchNorm2d(4)
    for hp in (hierpar.nn.BatchNorm2d(4), hierpar.nn.BatchNormAct2d(4)):
        check_state_dict_round_trip(hp, stock)
        assert hp.state_dict()._metadata[""]["version"] == stock.state_dict()._metadata[""]["version"]
    assert isinstance(hierpar.nn.BatchNorm2d(4), torch.nn.BatchNorm2d)


def test_batch_norm_rejects_wrong_dimensions_like_torch():
    for layer in (hierpar.nn.BatchNorm2d(3), hierpar.nn.BatchNormAct2d(3)):
        with pytest.raises(ValueError, match="expected 4D input"):
            layer(torch.randn(2, 3, 4))


# ---- ConvTranspose2d -------------------------------------------------------------------------------------

def random_conv_transpose(rng):
    groups = rng.choice([1, 1, 2, 3])
    stride = (rng.randint(1, 3), rng.randint(1, 3))
    dilation = (rng.randint(1, 2), rng.randint(1, 2))
    return dict(
        in_channels=groups * rng.randint(1, 4), out_channels=groups * rng.randint(1, 4),
        kernel_size=(rng.randint(1, 4), rng.randint(1, 4)), stride=stride,
        padding=(rng.randint(0, 2), rng.randint(0, 2)),
        output_padding=tuple(rng.randint(0, max(stride[i], dilation[i]) - 1) for i in range(2)),
        groups=groups, bias=rng.random() < 0.7, dilation=dilation)


def check_random_conv_modules(rng, hp_class, stock_class, random_args, input_hw, device, dtype, layout):
    """Three random modules of a kind against torch's: input_hw(rng, args) draws an input height and width."""
    for trial in range(3):
        args = random_args(rng)
        hp, stock = same_seeded_modules(hp_class, stock_class, args, trial, device, dtype)
        sizes = [rng.choice([1, rng.randint(1, 3)]), args["in_channels"], *input_hw(rng, args)]
        if rng.random() < 0.2:
            sizes = sizes[1:]
        x = random_tensor(sizes, dtype, device, layout)
        # TF32 off: both sides then compute in full fp32 (each follows cuDNN's TF32 flag), so the float32
        # tolerance applies; TF32 itself is tested per op in tests/test_conv_transpose.cpp.
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            check_same_module(hp, stock, x, f"{stock_class.__name__}({args}) on {tuple(sizes)} {dtype} {layout}",
                              grad=dtype != torch.float16 or device != "cpu")


def conv_transpose_input_hw(rng, args):
    """The smallest input size whose output size is positive, and up to 6 more."""
    smallest = [1 - min(0, ((args["dilation"][i] * (args["kernel_size"][i] - 1) + args["output_padding"][i] -
                             2 * args["padding"][i]) // args["stride"][i])) for i in range(2)]
    return [rng.randint(smallest[i], smallest[i] + 6) for i in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conv_transpose2d_matches_torch(seeded, device, dtype, layout):
    check_random_conv_modules(seeded, hierpar.nn.ConvTranspose2d, torch.nn.ConvTranspose2d, random_conv_transpose,
                              conv_transpose_input_hw, device, dtype, layout)


def test_conv_transpose2d_output_size_picks_the_same_size():
    hp = hierpar.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
    stock = torch.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
    stock.load_state_dict(hp.state_dict())
    x = torch.randn(2, 3, 5, 6)
    for size in ([9, 11], [10, 12]):
        out = hp(x, output_size=size)
        assert list(out.shape[-2:]) == size
        assert_close(out, stock(x, output_size=size), f"output_size={size}")


# ---- Conv2d --------------------------------------------------------------------------------------------

def random_conv(rng):
    groups = rng.choice([1, 1, 2, 3])
    padding_mode = rng.choice(["zeros", "zeros", "reflect", "replicate", "circular"])
    padding = rng.choice(["same", "valid", (rng.randint(0, 2), rng.randint(0, 2))])
    stride = (1, 1) if padding == "same" else (rng.randint(1, 3), rng.randint(1, 3))
    return dict(
        in_channels=groups * rng.randint(1, 4), out_channels=groups * rng.randint(1, 4),
        kernel_size=(rng.randint(1, 4), rng.randint(1, 4)), stride=stride, padding=padding,
        dilation=(rng.randint(1, 2), rng.randint(1, 2)), groups=groups, bias=rng.random() < 0.7,
        padding_mode=padding_mode)


def conv_input_hw(rng, args):
    """Reflection padding needs the padding below the input size: inputs at least kernel-sized and 3 wide."""
    return [rng.randint(3, 4) + args["dilation"][i] * (args["kernel_size"][i] - 1) + rng.randint(0, 4)
            for i in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conv2d_matches_torch(seeded, device, dtype, layout):
    check_random_conv_modules(seeded, hierpar.nn.Conv2d, torch.nn.Conv2d, random_conv, conv_input_hw, device, dtype,
                              layout)


@pytest.mark.parametrize("device", DEVICES)
def test_conv2d_fused_leaky_relu_matches_torch(device):
    """The discriminator's first layer (3 -> 16, kernel 4, stride 2, padding 1) with its LeakyReLU fused."""
    torch.manual_seed(0)
    hp = hierpar.nn.Conv2d(3, 16, 4, 2, 1, bias=False, device=device, dtype=torch.float64)
    stock = torch.nn.Conv2d(3, 16, 4, 2, 1, bias=False, device=device, dtype=torch.float64)
    stock.load_state_dict(hp.state_dict())
    x = torch.randn(2, 3, 9, 10, dtype=torch.float64, device=device).contiguous(memory_format=torch.channels_last)
    x_hp, x_stock = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = hp.forward_with_leaky_relu(x_hp, 0.2)
    ref = F.leaky_relu(stock(x_stock), 0.2)
    assert_close(out, ref, "forward_with_leaky_relu")
    upstream = torch.randn_like(ref)
    out.backward(upstream)
    ref.backward(upstream)
    assert_close(x_hp.grad, x_stock.grad, "grad_input")
    assert_close(hp.weight.grad, stock.weight.grad, "grad_weight")


def test_conv2d_scripts():
    layer = hierpar.nn.Conv2d(3, 4, 3, padding=1)
    scripted = torch.jit.script(layer)
    x = torch.randn(2, 3, 7, 6)
    assert torch.equal(scripted(x), layer(x))
    assert "hierpar::conv2d" in str(scripted.inlined_graph)


@pytest.mark.parametrize("kernel,dilation", [((3, 3), 1), ((4, 2), 1), ((2, 3), (2, 1))])
def test_functional_conv2d_padding_strings_match_torch(kernel, dilation):
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    w = torch.randn(5, 3, *kernel, dtype=torch.float64)
    for padding in ("same", "valid"):
        out = hierpar.conv2d(x, w, padding=padding, dilation=dilation)
        assert_close(out, F.conv2d(x, w, padding=padding, dilation=dilation), f"conv2d padding={padding!r}")
        if padding == "same":
            assert out.shape[-2:] == x.shape[-2:]
    scripted = torch.jit.script(_SamePadding())
    assert_close(scripted(x, w), F.conv2d(x, w, padding="same"), "scripted conv2d padding='same'")
    with pytest.raises(ValueError, match="padding: expected an int, a pair, 'same' or 'valid', got 'full'"):
        hierpar.conv2d(x, w, padding="full")
    with pytest.raises(ValueError, match="padding='same' is not supported for strided convolutions"):
        hierpar.conv2d(x, w, stride=2, padding="same")


class _SamePadding(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return hierpar.conv2d(x, w, padding="same")


def test_functional_forms_match_torch():
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    assert torch.equal(hierpar.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))
    out, idx = hierpar.max_pool2d(x, 2, return_indices=True)
    ref_out, ref_idx = F.max_pool2d(x, 2, return_indices=True)
    assert torch.equal(out, ref_out) and torch.equal(idx, ref_idx)
    w, b = torch.randn(3, 4, 3, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    assert_close(hierpar.conv_transpose2d(x, w, b, 2, 1, 1), F.conv_transpose2d(x, w, b, 2, 1, 1), "conv_t")
    w2, b2 = torch.randn(5, 3, 3, 2, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    assert_close(hierpar.conv2d(x, w2, b2, 2, 1, 1), F.conv2d(x, w2, b2, 2, 1, 1), "conv2d")
    assert_close(hierpar.conv2d(x, w2, None, 1, 1, leaky_relu_slope=0.2), F.leaky_relu(F.conv2d(x, w2, None, 1, 1), 0.2),
                 "conv2d + leaky_relu")
    mean, var = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    mean2, var2 = mean.clone(), var.clone()
    out = hierpar.batch_norm_act(x, mean, var, training=True, momentum=0.2, activation="leaky_relu",
                                 negative_slope=0.1)
    ref = F.leaky_relu(F.batch_norm(x, mean2, var2, training=True, momentum=0.2), 0.1)
    assert_close(out, ref, "batch_norm_act")
    assert_close(mean, mean2, "running_mean")
    assert_close(var, var2, "running_var")


def test_routing_ops_are_the_layers_table():
    """hierpar::conv_transpose2d_on_hierpar / conv2d_on_hierpar answer for the Python layers as the C++ table does: a
    CPU call always takes hierpar's op (which picks its own CPU kernels)."""
    x = random_tensor([2, 64, 8, 8])
    assert torch.ops.hierpar.conv_transpose2d_on_hierpar(x, random_tensor([64, 32, 4, 4]), [2, 2], [1, 1], [0, 0], 1,
                                                         [1, 1])
    assert torch.ops.hierpar.conv2d_on_hierpar(x, random_tensor([128, 64, 4, 4]), [2, 2], [1, 1], [1, 1], 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_layers_take_cudnn_where_the_table_says():
    """A generator's middle layer and a wide discriminator layer run torch's convolutions on the GPU, the output layer
    (float32 channels_last, C_in % 16 == 0) hierpar's; each agrees with torch."""
    middle = hierpar.nn.ConvTranspose2d(64, 32, 4, 2, 1, bias=False).cuda()
    output = hierpar.nn.ConvTranspose2d(32, 3, 4, 2, 1, bias=False).cuda()
    wide = hierpar.nn.Conv2d(64, 128, 4, 2, 1, bias=False).cuda()
    x = random_tensor([2, 64, 8, 8], device="cuda")
    h = random_tensor([2, 32, 16, 16], device="cuda").contiguous(memory_format=torch.channels_last)

    def ops_of(call):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return {event.name for event in prof.events()}

    assert "hierpar::conv_transpose2d" not in ops_of(lambda: middle(x))
    assert "hierpar::conv2d" not in ops_of(lambda: wide(x))
    assert "hierpar::conv_transpose2d" in ops_of(lambda: output(h))
    tf32 = dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(middle(x), F.conv_transpose2d(x, middle.weight, None, 2, 1), **tf32)
    torch.testing.assert_close(wide(x), F.conv2d(x, wide.weight, None, 2, 1), **tf32)
    torch.testing.assert_close(output(h), F.conv_transpose2d(h, output.weight, None, 2, 1), **tf32)
