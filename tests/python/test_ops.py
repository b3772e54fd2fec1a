"""torch.library.opcheck on every hierpar op (forward and backward) and dtype: the schema matches what the
kernels do (no undeclared mutation or aliasing), the Autograd registration is right, the Meta kernels agree
with the real ones on FakeTensors, and AOTAutograd traces the op with static and dynamic shapes."""
import pytest
import torch
from torch.library import opcheck

import hierpar  # noqa: F401  (registers torch.ops.hierpar)
from conftest import DEVICES, random_tensor

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
hp = torch.ops.hierpar


def max_pool2d_samples(dtype, device):
    for layout, args in [("contiguous", ([3, 2], [2, 1], [1, 1], [1, 1], True)),
                         ("channels_last", ([2, 2], [], [0, 0], [1, 1], False)),
                         ("strided", ([3, 3], [2, 2], [1, 0], [2, 1], False)),
                         ("contiguous", ([2, 2], [], [0, 0], [1, 1], False, True))]:  # relu: pools relu(x)
        x = random_tensor([2, 3, 9, 8], dtype, device, layout).requires_grad_()
        yield (x, *args)


def max_pool2d_backward_samples(dtype, device):
    for x, *args in max_pool2d_samples(dtype, device):
        with torch.no_grad():
            out, indices = hp.max_pool2d(x, *args)
        yield (torch.randn_like(out), indices, list(x.shape), *args[:5])  # (the backward takes no relu)


def batch_norm_act_samples(dtype, device):
    params = torch.float64 if dtype == torch.float64 else torch.float32  # low precision: float32 statistics

    def stats():
        return (torch.randn(3, dtype=params, device=device), torch.rand(3, dtype=params, device=device) + 0.5)

    for layout in ("contiguous", "channels_last"):
        x = random_tensor([4, 3, 5, 6], dtype, device, layout).requires_grad_()
        w = (torch.rand(3, dtype=params, device=device) + 0.5).requires_grad_()
        b = torch.randn(3, dtype=params, device=device).requires_grad_()
        yield (x, w, b, *stats(), True, 0.1, 1e-5, "relu", 0.01)
        yield (x, w, b, *stats(), False, 0.1, 1e-5, "leaky_relu", 0.2)
        yield (x, None, None, None, None, True, 0.1, 1e-3, "identity", 0.01)


def batch_norm_act_backward_samples(dtype, device):
    for x, w, b, mean, var, training, momentum, eps, activation, slope in batch_norm_act_samples(dtype, device):
        with torch.no_grad():  # the backward op's inputs are plain tensors, as its Autograd caller passes them
            out, save_mean, save_invstd = hp.batch_norm_act(x, w, b, mean, var, training, momentum, eps, activation,
                                                            slope)
        mask = [True, w is not None, b is not None]
        yield (torch.randn_like(out), out, x.detach() if activation == "relu" else None,
               None if w is None else w.detach(), None if b is None else b.detach(), save_mean, save_invstd,
               training, eps, activation, slope, mask)


def conv_transpose2d_samples(dtype, device):
    x = random_tensor([2, 4, 5, 6], dtype, device, "contiguous").requires_grad_()
    w = random_tensor([4, 3, 3, 2], dtype, device).requires_grad_()
    b = random_tensor([3], dtype, device).requires_grad_()
    yield (x, w, b, [2, 1], [1, 0], [1, 0], 1, [1, 1])
    x2 = random_tensor([1, 4, 4, 3], dtype, device, "channels_last").requires_grad_()
    w2 = random_tensor([4, 1, 2, 3], dtype, device).requires_grad_()
    yield (x2, w2, None, [1, 2], [0, 1], [0, 1], 2, [2, 1])


def conv_transpose2d_backward_samples(dtype, device):
    for x, w, b, stride, padding, output_padding, groups, dilation in conv_transpose2d_samples(dtype, device):
        with torch.no_grad():
            out = hp.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation)
        yield (torch.randn_like(out), x.detach(), w.detach(), stride, padding, output_padding, groups, dilation,
               [True, True, b is not None])


def conv2d_samples(dtype, device):
    x = random_tensor([2, 4, 7, 6], dtype, device, "contiguous").requires_grad_()
    w = random_tensor([3, 4, 3, 2], dtype, device).requires_grad_()
    b = random_tensor([3], dtype, device).requires_grad_()
    yield (x, w, b, [2, 1], [1, 0], [1, 1], 1, None)
    # DCGAN's first discriminator layer (the small-C_in route) with its fused LeakyReLU.
    x2 = random_tensor([2, 3, 8, 6], dtype, device, "channels_last").requires_grad_()
    w2 = random_tensor([16, 3, 4, 4], dtype, device).requires_grad_()
    yield (x2, w2, None, [2, 2], [1, 1], [1, 1], 1, 0.2)
    x3 = random_tensor([1, 4, 6, 5], dtype, device, "strided").requires_grad_()
    w3 = random_tensor([4, 2, 2, 3], dtype, device).requires_grad_()
    yield (x3, w3, None, [1, 2], [0, 1], [2, 1], 2, None)


def conv2d_backward_samples(dtype, device):
    for x, w, b, stride, padding, dilation, groups, _ in conv2d_samples(dtype, device):
        with torch.no_grad():
            out = hp.conv2d(x, w, b, stride, padding, dilation, groups)
        yield (torch.randn_like(out), x.detach(), w.detach(), stride, padding, dilation, groups,
               [True, True, b is not None])


def fused_adam_samples(dtype, device, tensor_lr=False):
    shapes = [[7], [3, 5], [2, 3, 4, 4]]
    params = [random_tensor(shape, dtype, device) for shape in shapes]
    grads = [random_tensor(shape, dtype, device) for shape in shapes]
    exp_avgs = [random_tensor(shape, dtype, device) * 0.1 for shape in shapes]
    exp_avg_sqs = [random_tensor(shape, dtype, device).abs() * 0.01 for shape in shapes]
    steps = [torch.full((), 3.0, device=device) for _ in shapes]
    lr_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lr = torch.full((), 1e-2, dtype=lr_dtype, device=device) if tensor_lr else 1e-2
    for amsgrad in (False, True):
        maxs = [random_tensor(shape, dtype, device).abs() * 0.01 for shape in shapes] if amsgrad else []
        yield ((params, grads, exp_avgs, exp_avg_sqs, maxs, steps),
               dict(lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=amsgrad))


def fused_adam_tensor_lr_samples(dtype, device):
    yield from fused_adam_samples(dtype, device, tensor_lr=True)


SAMPLES = {
    hp.max_pool2d.default: max_pool2d_samples,
    hp.max_pool2d_backward.default: max_pool2d_backward_samples,
    hp.batch_norm_act.default: batch_norm_act_samples,
    hp.batch_norm_act_backward.default: batch_norm_act_backward_samples,
    hp.conv_transpose2d.default: conv_transpose2d_samples,
    hp.conv_transpose2d_backward.default: conv_transpose2d_backward_samples,
    hp.conv2d.default: conv2d_samples,
    hp.conv2d_backward.default: conv2d_backward_samples,
    # The layers' routed calls (CompositeImplicitAutograd) take their ops' arguments.
    hp.conv_transpose2d_layer.default: conv_transpose2d_samples,
    hp.conv2d_layer.default: conv2d_samples,
    hp.fused_adam_.default: fused_adam_samples,
    hp.fused_adam_.tensor_lr: fused_adam_tensor_lr_samples,
}


def test_every_op_is_covered():
    registered = {name for name in dir(hp) if not name.startswith("_") and
                  isinstance(getattr(hp, name), torch._ops.OpOverloadPacket)}
    assert registered == {op._schema.name.split("::")[1] for op in SAMPLES}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(SAMPLES), ids=lambda op: op._schema.name.split("::")[1])
def test_opcheck(op, dtype, device):
    for sample in SAMPLES[op](dtype, device):
        args, kwargs = sample if isinstance(sample[-1], dict) else (sample, {})
        opcheck(op, args, kwargs)


def test_convolutions_have_second_derivatives():
    """gradgradcheck in float64: an R1 or WGAN-GP penalty differentiates a gradient of these ops."""
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: hierpar.conv_transpose2d(a, b, stride=2), (x, w))
    v = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: hierpar.conv2d(a, b, padding=1), (x, v))


def test_batch_norm_relu_has_second_derivatives():
    """gradgradcheck in float64 of BatchNorm + ReLU in training mode, which keeps its input (identity and leaky_relu
    keep it inside a C++ hierpar::ops::DoubleBackwardScope; tests/test_batch_norm_act.cpp checks those)."""
    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(2, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(a, weight, bias):
        return torch.ops.hierpar.batch_norm_act(a, weight, bias, None, None, True, 0.1, 1e-5, "relu", 0.0, None)[0]

    assert torch.autograd.gradgradcheck(f, (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_max_pool2d_relu_is_relu_then_pool(device):
    """relu=True pools relu(x) in one pass: torch's relu then max_pool2d, values and gradients, and gradgradcheck."""
    x = random_tensor([2, 3, 8, 6], torch.float64, device).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, indices = hp.max_pool2d(x, [2, 2], [], [0, 0], [1, 1], False, True)
    ref = torch.nn.functional.max_pool2d(torch.relu(x_ref), 2)
    assert torch.equal(out, ref)
    assert bool((indices == 255).eq(ref == 0).all())  # 255: the window's maximum was <= 0, no element chosen
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.autograd.gradgradcheck(lambda a: hp.max_pool2d(a, [2, 2], [], [0, 0], [1, 1], False, True)[0],
                                        (x.detach().requires_grad_(),))
