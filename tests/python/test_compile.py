"""torch.compile(fullgraph=True) and torch.export trace a small model that uses every hierpar op (forward and,
through AOTAutograd, every backward op) without graph breaks, and the compiled/exported programs compute what
eager mode does. One inductor compilation (CPU inductor compiles C++ with gcc: the slow part)."""
import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import hierpar
from conftest import random_tensor


class SmallNet(torch.nn.Module):
    """ConvTranspose2d -> BatchNormAct2d(leaky_relu) -> MaxPool2d -> BatchNorm2d -> ConvTranspose2d ->
    Conv2d with its LeakyReLU fused."""

    def __init__(self):
        super().__init__()
        self.deconv = hierpar.nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1, bias=False)
        self.bn_act = hierpar.nn.BatchNormAct2d(6, activation="leaky_relu", negative_slope=0.2)
        self.pool = hierpar.nn.MaxPool2d(2)
        self.bn = hierpar.nn.BatchNorm2d(6)
        self.head = hierpar.nn.ConvTranspose2d(6, 2, 3, padding=1)
        self.conv = hierpar.nn.Conv2d(2, 3, 4, stride=2, padding=1, bias=False)

    @staticmethod
    def output_size(n, h, w):
        return (n, 3, h // 2, w // 2)  # the deconv doubles, the pool halves, the head keeps, the conv halves (floor)

    def forward(self, x):
        return self.conv.forward_with_leaky_relu(self.head(self.bn(self.pool(self.bn_act(self.deconv(x))))), 0.2)


OPS = {"conv_transpose2d", "batch_norm_act", "max_pool2d", "conv2d"}


def hierpar_ops_in(graph):
    """Names of the hierpar ops called in an FX graph (directly or through auto_functionalized)."""
    names = set()
    for node in graph.nodes:
        for target in [node.target, *(a for a in node.args if isinstance(a, torch._ops.OpOverload))]:
            name = str(target)
            if name.startswith("hierpar."):
                names.add(name.split(".")[1])
    return names


def train_step(model, x, upstream):
    out = model(x)
    out.backward(upstream)
    return out


def test_compile_fullgraph_records_every_forward_and_backward_op():
    """AOTAutograd's forward graph holds the three ops, its backward graph the three backward ops."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model = SmallNet()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    x = random_tensor([3, 4, 5, 6])
    train_step(compiled, x, torch.randn(SmallNet.output_size(3, 5, 6)))
    assert len(graphs) == 2, "expected one forward and one backward graph (no graph break)"
    assert hierpar_ops_in(graphs[0]) == OPS
    assert hierpar_ops_in(graphs[1]) == {name + "_backward" for name in OPS}


def test_compile_inductor_matches_eager():
    torch._dynamo.reset()
    eager = SmallNet()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    for step in range(2):  # the second call reuses the compiled graph (same shapes)
        x = random_tensor([3, 4, 5, 6])
        upstream = torch.randn(SmallNet.output_size(3, 5, 6))
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.testing.assert_close(train_step(compiled, x_compiled, upstream), train_step(eager, x_eager, upstream))
        torch.testing.assert_close(x_compiled.grad, x_eager.grad)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"grad of {name}: {m}")
        for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers()):
            torch.testing.assert_close(b, c, msg=lambda m: f"buffer {name} after step {step}: {m}")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_export(training):
    model = SmallNet().train(training)
    reference = copy.deepcopy(model)
    x = random_tensor([3, 4, 5, 6])
    exported = torch.export.export(model, (x,))
    assert hierpar_ops_in(exported.graph) == OPS
    module = exported.module()
    torch.testing.assert_close(module(x), reference(x))
    if training:  # the running statistics were updated in the exported module's buffers as in eager
        for (name, b), (_, c) in zip(module.named_buffers(), reference.named_buffers()):
            torch.testing.assert_close(b, c, msg=lambda m: f"buffer {name}: {m}")


def test_compile_dynamic_shapes_matches_eager():
    """dynamic=True traces with symbolic batch and spatial sizes and stays correct over changing shapes.
    (The C++ Meta and Autograd kernels read concrete sizes, which specialises them: each new shape is a
    recompilation, not a failure; docs/python.md.) aot_eager: AOTAutograd without inductor's code generation."""
    torch._dynamo.reset()
    eager = SmallNet()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for n, h, w in [(2, 5, 6), (5, 7, 4)]:
        x = random_tensor([n, 4, h, w])
        upstream = torch.randn(SmallNet.output_size(n, h, w))
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.testing.assert_close(train_step(compiled, x_compiled, upstream), train_step(eager, x_eager, upstream))
        torch.testing.assert_close(x_compiled.grad, x_eager.grad)
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"grad of {name}: {m}")
            p.grad, q.grad = None, None
