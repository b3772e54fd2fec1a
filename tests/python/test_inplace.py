"""In-place ops on a hierpar.nn layer's output behave as on the same torch.nn layer's: where stock's backward works,
hierpar's gives the same output and gradients (input and every parameter, float64 on the CPU); where autograd refuses
stock's backward (a tensor it saved was modified in place), it refuses hierpar's too.

What each side saves for backward decides it: torch's batch norm, convolutions and max pooling keep their input, so
an in-place op on their output is fine; ReLU and LeakyReLU(inplace=True) keep their result, so an in-place op after
them is refused. hierpar's BatchNorm2d keeps its input, BatchNormAct2d(relu) its input and output, BatchNormAct2d
(leaky_relu) its output (docs/batch_norm_act.md).
"""
import pytest
import torch

import hierpar
from conftest import random_tensor

RTOL, ATOL = 1e-9, 1e-9
INPLACE_ERROR = "modified by an inplace operation"


def batch_norms(rng, channels, activation):
    """hierpar's batch-norm layer with `activation` fused ("identity": BatchNorm2d) and torch.nn's BatchNorm2d
    followed by the activation as the DCGAN writes it (in place), with the same non-trivial state."""
    slope = 0.2
    if activation == "identity":
        hp = hierpar.nn.BatchNorm2d(channels, dtype=torch.float64)
        stock = torch.nn.BatchNorm2d(channels, dtype=torch.float64)
        bn = stock
    else:
        hp = hierpar.nn.BatchNormAct2d(channels, dtype=torch.float64, activation=activation, negative_slope=slope)
        bn = torch.nn.BatchNorm2d(channels, dtype=torch.float64)
        act = torch.nn.ReLU(inplace=True) if activation == "relu" else torch.nn.LeakyReLU(slope, inplace=True)
        stock = torch.nn.Sequential(bn, act)
    with torch.no_grad():
        bn.weight.copy_(torch.rand_like(bn.weight) + 0.5)
        bn.bias.copy_(torch.rand_like(bn.bias) * 2 - 1)
        bn.running_mean.copy_(torch.randn_like(bn.running_mean))
        bn.running_var.copy_(torch.rand_like(bn.running_var) + 0.5)
    hp.load_state_dict(bn.state_dict())
    return hp, stock, (rng.randint(1, 9), rng.randint(2, 9))


def convs(rng, channels, transposed):
    out_channels = rng.choice([1, 3, 5])
    args = dict(kernel_size=(rng.randint(1, 3), rng.randint(1, 3)), stride=rng.randint(1, 2), padding=rng.randint(0, 1),
                bias=rng.random() < 0.7, dtype=torch.float64)
    hp_class, stock_class = ((hierpar.nn.ConvTranspose2d, torch.nn.ConvTranspose2d) if transposed
                             else (hierpar.nn.Conv2d, torch.nn.Conv2d))
    hp = hp_class(channels, out_channels, **args)
    stock = stock_class(channels, out_channels, **args)
    stock.load_state_dict(hp.state_dict())
    return hp, stock, (rng.randint(3, 9), rng.randint(3, 9))


def max_pools(rng, channels):
    args = dict(kernel_size=rng.choice([2, 3]), stride=rng.choice([None, 1, 2]), ceil_mode=rng.random() < 0.5)
    return hierpar.nn.MaxPool2d(**args), torch.nn.MaxPool2d(**args), (rng.randint(3, 9), rng.randint(3, 9))


LAYERS = {
    "BatchNorm2d": lambda rng, c: batch_norms(rng, c, "identity"),
    "BatchNormAct2d(relu)": lambda rng, c: batch_norms(rng, c, "relu"),
    "BatchNormAct2d(leaky_relu)": lambda rng, c: batch_norms(rng, c, "leaky_relu"),
    "Conv2d": lambda rng, c: convs(rng, c, transposed=False),
    "ConvTranspose2d": lambda rng, c: convs(rng, c, transposed=True),
    "MaxPool2d": max_pools,
}

INPLACE_OPS = {
    "ReLU(inplace=True)": torch.nn.ReLU(inplace=True),
    "LeakyReLU(0.2, inplace=True)": torch.nn.LeakyReLU(0.2, inplace=True),
    "torch.relu_": torch.relu_,
    "add_(1)": lambda t: t.add_(1),
    "mul_(2)": lambda t: t.mul_(2),
}

# Which pairs autograd refuses on stock's side: after an activation that keeps its result.
REFUSED = {"BatchNormAct2d(relu)", "BatchNormAct2d(leaky_relu)"}


def forward_backward(layer, op, x, upstream_seed):
    """op(layer(x)) and its backward from a random upstream gradient: (output, grad_input, parameter grads), or the
    RuntimeError that the backward raised (with the output)."""
    x = x.detach().clone().requires_grad_()
    out = op(layer(x))
    generator = torch.Generator().manual_seed(upstream_seed)
    upstream = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    try:
        out.backward(upstream)
    except RuntimeError as error:
        return out.detach(), error, None
    return out.detach(), x.grad, [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("op_name", list(INPLACE_OPS))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_inplace_op_after_layer_matches_torch(seeded, layer_name, op_name, training, layout):
    rng = seeded
    channels = rng.choice([1, 3, 5])
    hp, stock, (h, w) = LAYERS[layer_name](rng, channels)
    hp.train(training), stock.train(training)
    sizes = [rng.choice([1, 1, 2, 3]), channels, h | 1, w | 1]  # odd spatial sizes, batch 1 often
    x = random_tensor(sizes, torch.float64, layout=layout)
    what = f"{layer_name} -> {op_name} on {tuple(sizes)} {layout} ({'train' if training else 'eval'})"
    op = INPLACE_OPS[op_name]
    seed = rng.randrange(2**31)
    out_hp, grad_hp, param_grads_hp = forward_backward(hp, op, x, seed)
    out_stock, grad_stock, param_grads_stock = forward_backward(stock, op, x, seed)
    torch.testing.assert_close(out_hp, out_stock, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: output: {m}")
    if isinstance(grad_stock, RuntimeError):
        assert INPLACE_ERROR in str(grad_stock), f"{what}: stock's backward failed otherwise: {grad_stock}"
        assert isinstance(grad_hp, RuntimeError), f"{what}: stock's backward is refused, hierpar's ran"
        assert INPLACE_ERROR in str(grad_hp), f"{what}: hierpar's backward failed otherwise: {grad_hp}"
        assert layer_name in REFUSED, f"{what}: stock refused a backward this test expects to work: {grad_stock}"
        return
    assert layer_name not in REFUSED, f"{what}: stock's backward ran where this test expects autograd to refuse it"
    assert not isinstance(grad_hp, RuntimeError), f"{what}: stock's backward works, hierpar's raised: {grad_hp}"
    torch.testing.assert_close(grad_hp, grad_stock, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: grad_input: {m}")
    names = [name for name, _ in hp.named_parameters()]
    assert len(param_grads_hp) == len(param_grads_stock), what
    for name, g_hp, g_stock in zip(names, param_grads_hp, param_grads_stock):
        torch.testing.assert_close(g_hp, g_stock, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: grad of {name}: {m}")
    for (name, b_hp), b_stock in zip(hp.named_buffers(), stock.buffers()):
        torch.testing.assert_close(b_hp, b_stock, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: buffer {name}: {m}")


def test_leaky_relu_fused_keeps_its_output_where_out_of_place_stock_keeps_its_input(seeded):
    """Against BatchNorm2d + LeakyReLU(inplace=False) (the out-of-place activation keeps its input, not its result)
    stock's backward after an in-place op on the output works and hierpar's BatchNormAct2d(leaky_relu) is refused:
    the one pairing where the two differ, and why hierpar.nn.convert does not fuse such a LeakyReLU when its output
    may be modified in place. Against ReLU(inplace=False), which keeps its result, both refuse."""
    for activation, stock_act in (("leaky_relu", torch.nn.LeakyReLU(0.2)), ("relu", torch.nn.ReLU())):
        hp, _, _ = batch_norms(seeded, 3, activation)
        bn = torch.nn.BatchNorm2d(3, dtype=torch.float64)
        bn.load_state_dict(hp.state_dict())
        stock = torch.nn.Sequential(bn, stock_act)
        x = random_tensor([2, 3, 5, 3], torch.float64)
        op = INPLACE_OPS["add_(1)"]
        out_hp, grad_hp, _ = forward_backward(hp, op, x, 7)
        out_stock, grad_stock, _ = forward_backward(stock, op, x, 7)
        torch.testing.assert_close(out_hp, out_stock, rtol=RTOL, atol=ATOL)
        assert isinstance(grad_hp, RuntimeError) and INPLACE_ERROR in str(grad_hp), activation
        if activation == "relu":
            assert isinstance(grad_stock, RuntimeError) and INPLACE_ERROR in str(grad_stock)
        else:
            assert not isinstance(grad_stock, RuntimeError), grad_stock
