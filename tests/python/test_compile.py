"""torch.compile(fullgraph=True) and torch.export trace a small model that uses every hierpar op (forward and,
through AOTAutograd, every backward op) without graph breaks, and the compiled/exported programs compute what
eager mode does; pytorch/examples' DCGAN models converted by hierpar.nn.convert compile with no more graphs and graph
breaks than the stock ones. One inductor compilation (CPU inductor compiles C++ with gcc: the slow part); the rest
runs on aot_eager (AOTAutograd without code generation)."""
import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import hierpar
from conftest import random_tensor
from test_convert import dcgan


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


# What the layers call: the convolution layers' ops (CompositeImplicitAutograd) hold the routing decision.
LAYER_OPS = {"conv_transpose2d_layer", "batch_norm_act", "max_pool2d", "conv2d_layer"}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_export(training):
    """The exported program keeps the layers' ops (each routes when the program runs, on the device it runs on);
    run_decompositions() lowers them to the ops they chose for the example input (hierpar's, on the CPU)."""
    model = SmallNet().train(training)
    x = random_tensor([3, 4, 5, 6])
    for lower in (False, True):
        # A program of its own each (an exported program shares its buffers with the module it was exported from).
        program = torch.export.export(copy.deepcopy(model), (x,))
        if lower:
            program = program.run_decompositions()
        assert hierpar_ops_in(program.graph) == (OPS if lower else LAYER_OPS)
        reference = copy.deepcopy(model)
        module = program.module()
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


# ---- the DCGAN of pytorch/examples, converted by hierpar.nn.convert --------------------------------------------

def compiled_steps(model, inputs, upstreams):
    """torch.compile(model) with a counting backend over AOTAutograd (aot_eager: no code generation), one forward and
    backward per input. Returns (graphs compiled, graph breaks, the dynamo graphs, [(output, grad_input)])."""
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    results = eager_steps(torch.compile(model, backend=backend), inputs, upstreams)
    return backend.frame_count, sum(counters["graph_break"].values()), backend.graphs, results


def eager_steps(model, inputs, upstreams):
    """One forward and backward of `model` per input: [(output, grad_input)]."""
    results = []
    for x, upstream in zip(inputs, upstreams):
        x = x.clone().requires_grad_()
        out = model(x)
        out.backward(upstream)
        results.append((out.detach(), x.grad))
    return results


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("net", ["Generator", "Discriminator"])
def test_converted_dcgan_compiles_like_stock(net, device):
    """The converted model has no graph break (as the stock one) and compiles no more graphs than stock over two calls
    of one shape and one of another batch size; compiled results equal eager ones. On a GPU the layers' routing
    decision is inside hierpar's conv*_layer ops, so the dynamo graph holds them with no break."""
    stock = dict(zip(["Generator", "Discriminator"], dcgan(torch.float64)))[net].to(device)
    converted = hierpar.nn.convert(copy.deepcopy(stock))
    eager = copy.deepcopy(converted)
    shape = [16, 1, 1] if net == "Generator" else [3, 64, 64]
    inputs = [random_tensor([n, *shape], torch.float64, device) for n in (4, 4, 3)]
    out_shape = (lambda n: [n, 3, 64, 64]) if net == "Generator" else (lambda n: [n])
    upstreams = [torch.randn(out_shape(x.shape[0]), dtype=torch.float64, device=device) for x in inputs]

    stock_frames, stock_breaks, stock_graphs, stock_results = compiled_steps(stock, inputs, upstreams)
    frames, breaks, graphs, results = compiled_steps(converted, inputs, upstreams)
    assert stock_breaks == 0 and breaks == 0, f"graph breaks: stock {stock_breaks}, converted {breaks}"
    assert frames <= stock_frames, f"graphs compiled: converted {frames}, stock {stock_frames}"
    assert frames == len(graphs) and frames >= 1
    layer_op = "conv_transpose2d_layer" if net == "Generator" else "conv2d_layer"
    assert {layer_op, "batch_norm_act"} <= hierpar_ops_in(graphs[0].graph)
    assert not hierpar_ops_in(stock_graphs[0].graph)
    tolerance = dict(rtol=1e-9, atol=1e-9)
    for i, ((out, grad), (out_eager, grad_eager), (out_stock, grad_stock)) in enumerate(
            zip(results, eager_steps(eager, inputs, upstreams), stock_results)):
        torch.testing.assert_close(out, out_eager, **tolerance, msg=lambda m: f"call {i}: output against eager: {m}")
        torch.testing.assert_close(grad, grad_eager, **tolerance, msg=lambda m: f"call {i}: grad_input, eager: {m}")
        torch.testing.assert_close(out, out_stock, **tolerance, msg=lambda m: f"call {i}: output against stock: {m}")
        torch.testing.assert_close(grad, grad_stock, **tolerance, msg=lambda m: f"call {i}: grad_input, stock: {m}")
    for (name, p), (_, q) in zip(converted.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance, msg=lambda m: f"accumulated grad of {name}: {m}")
    for (name, b), (_, c) in zip(converted.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b, c, **tolerance, msg=lambda m: f"buffer {name}: {m}")
