"""Bad input reaches Python as a RuntimeError carrying the C++ kernel's TORCH_CHECK message (naming the
argument and what was expected); the layers' own argument checks raise ValueError like torch.nn's."""
import re

import pytest
import torch

import hierpar
from conftest import DEVICES


def raises(substring):
    return pytest.raises(RuntimeError, match=re.escape(substring))


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_max_pool2d_errors(device):
    x = torch.randn(2, 3, 8, 8, device=device)
    with raises("expected input of 3 (C, H, W) or 4 (N, C, H, W) dimensions, got 2"):
        hierpar.max_pool2d(x[0, 0], 2)
    with raises("kernel_size"):
        hierpar.max_pool2d(x, 0)
    with raises("window"):  # hierpar keeps uint8 window offsets: windows of up to 256 elements
        hierpar.max_pool2d(torch.randn(1, 1, 40, 40, device=device), 17)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_batch_norm_act_errors(device):
    x = torch.randn(4, 3, 5, 5, device=device)
    mean, var = torch.zeros(3, device=device), torch.ones(3, device=device)
    with raises('activation: expected "identity", "relu" or "leaky_relu", got "gelu"'):
        hierpar.batch_norm_act(x, mean, var, activation="gelu")
    with raises("running_mean: expected 3 elements (input channels), got 4"):
        hierpar.batch_norm_act(x, torch.zeros(4, device=device), var)
    with raises("running_mean: expected running statistics in eval mode (training=false), got none"):
        hierpar.batch_norm_act(x, None, None, training=False)
    with raises("weight: expected dtype Double"):
        hierpar.batch_norm_act(x.double(), mean.double(), var.double(), weight=torch.ones(3, device=device))
    with raises("expected more than 1 value per channel when training"):
        hierpar.batch_norm_act(x[:1, :, :1, :1], mean, var, training=True)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_conv_transpose2d_errors(device):
    x = torch.randn(2, 4, 5, 5, device=device)
    w = torch.randn(4, 3, 3, 3, device=device)
    with raises("conv_transpose2d: weight must be 4-d"):
        hierpar.conv_transpose2d(x, w[0])
    with raises("conv_transpose2d: weight's dtype"):
        hierpar.conv_transpose2d(x, w.double())
    with raises("conv_transpose2d: stride must be positive"):
        hierpar.conv_transpose2d(x, w, stride=0)
    with raises("conv_transpose2d: groups (3"):
        hierpar.conv_transpose2d(x, w, groups=3)


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_every_op_error_begins_with_the_op_name(device):
    x = torch.randn(2, 4, 5, 5, device=device)
    w = torch.randn(4, 3, 3, 3, device=device)
    mean, var = torch.zeros(4, device=device), torch.ones(4, device=device)
    p = torch.randn(3, device=device)
    calls = {
        "max_pool2d": lambda: torch.ops.hierpar.max_pool2d(x, [0, 0], [], [0, 0], [1, 1], False),
        "batch_norm_act": lambda: hierpar.batch_norm_act(x, mean, var, activation="gelu"),
        "conv_transpose2d": lambda: hierpar.conv_transpose2d(x, w, stride=0),
        "conv2d": lambda: hierpar.conv2d(x, w, stride=0),
        "fused_adam_": lambda: torch.ops.hierpar.fused_adam_(
            [p], [p.clone()], [p.clone()], [p.clone()], [], [torch.zeros((), device=device)], lr=-1.0, beta1=0.9,
            beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False),
    }
    for op, call in calls.items():
        with pytest.raises(RuntimeError) as error:
            call()
        assert str(error.value).startswith(f"hierpar::{op}: "), f"{op}: {str(error.value).splitlines()[0]}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_mismatch():
    with raises("running_mean: expected a tensor on cuda"):
        hierpar.batch_norm_act(torch.randn(2, 3, 4, 4, device="cuda"), torch.zeros(3), torch.ones(3))


def test_double_backward_of_batch_norm_act_without_its_input_is_refused_with_a_message():
    """leaky_relu keeps only its output; a second derivative needs the input (C++: hierpar::ops::DoubleBackwardScope)."""
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    out = hierpar.batch_norm_act(x, None, None, torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64),
                                 training=True, activation="leaky_relu", negative_slope=0.2)
    with raises("a second derivative (create_graph) needs the layer's input, which leaky_relu does not keep"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)



def test_layer_argument_errors():
    with pytest.raises(ValueError, match="activation must be one of"):
        hierpar.nn.BatchNormAct2d(3, activation="gelu")
    with pytest.raises(ValueError, match="negative_slope must be > 0"):
        hierpar.nn.BatchNormAct2d(3, activation="leaky_relu", negative_slope=0.0)
    with pytest.raises(ValueError, match="Only `zeros` padding mode"):
        layer = hierpar.nn.ConvTranspose2d(2, 2, 3)
        layer.padding_mode = "reflect"
        layer(torch.randn(1, 2, 4, 4))
