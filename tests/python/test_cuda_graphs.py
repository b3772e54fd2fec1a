"""A converted model under PyTorch's own CUDA graph tools, used as their docs say: a whole training step captured with
torch.cuda.graph and replayed, and torch.cuda.make_graphed_callables, each against the same steps run eagerly. Needs a
GPU; skips without one."""
import copy

import pytest
import torch

import hierpar
from conftest import random_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.fixture(autouse=True)
def full_float32():
    """float32 convolutions without TF32, so that eager and captured runs agree to float32 rounding whichever
    algorithms cuDNN picks for each."""
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = allowed


def small_generator():
    """A DCGAN-like generator as a user writes it, with in-place ReLUs after its BatchNorms."""
    return torch.nn.Sequential(
        torch.nn.ConvTranspose2d(8, 16, 4, 1, 0, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(True),
        torch.nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(True),
        torch.nn.ConvTranspose2d(8, 3, 4, 2, 1, bias=False), torch.nn.Tanh())


def step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
    return loss


def assert_parameters_close(actual, expected):
    for (name, p), (_, q) in zip(actual.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for (name, b), (_, c) in zip(actual.named_buffers(), expected.named_buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=lambda m: f"buffer {name}: {m}")


def test_whole_step_captured_with_torch_cuda_graph_equals_eager_steps():
    device = torch.device("cuda")
    eager = small_generator().to(device)
    graphed = hierpar.nn.convert(copy.deepcopy(eager))
    x = random_tensor([6, 8, 1, 1], torch.float32, device)
    target = random_tensor([6, 3, 16, 16], torch.float32, device).tanh()
    # SGD with momentum: its state lives on the device, and it does not turn rounding-level gradient differences near
    # zero into full steps of either sign, as Adam does.
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    graphed_opt = torch.optim.SGD(graphed.parameters(), lr=0.05, momentum=0.9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(graphed, graphed_opt, x, target)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graphed_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(graphed, graphed_opt, x, target)
    losses = []
    for _ in range(4):
        graph.replay()
        losses.append(static_loss.clone())
    for _ in range(3 + 4):
        expected_loss = step(eager, eager_opt, x, target)
    torch.testing.assert_close(losses[-1], expected_loss, rtol=1e-4, atol=1e-5)
    assert not torch.equal(losses[0], losses[-1])  # the replays trained
    assert_parameters_close(graphed, eager)


def test_make_graphed_callables_behaves_as_with_torch_nn_layers():
    """The converted model graphed by make_graphed_callables gives what torch.nn's model graphed the same way gives:
    outputs, input gradients and parameter gradients (with make_graphed_callables' own accumulation semantics), and
    the outputs of the eager model."""
    device = torch.device("cuda")
    stock = small_generator().to(device)
    eager = copy.deepcopy(stock)
    converted = hierpar.nn.convert(copy.deepcopy(stock))
    sample = random_tensor([6, 8, 1, 1], torch.float32, device).requires_grad_()
    graphed = {"stock": torch.cuda.make_graphed_callables(stock, (sample,)),
               "hierpar": torch.cuda.make_graphed_callables(converted, (sample,))}
    for model in (stock, converted):
        model.zero_grad(set_to_none=True)
    for _ in range(2):
        x = random_tensor([6, 8, 1, 1], torch.float32, device)
        upstream = random_tensor([6, 3, 16, 16], torch.float32, device)
        inputs = {impl: x.clone().requires_grad_() for impl in graphed}
        outputs = {impl: graphed[impl](inputs[impl]) for impl in graphed}
        torch.testing.assert_close(outputs["hierpar"], outputs["stock"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(outputs["hierpar"], eager(x), rtol=1e-4, atol=1e-5)
        for impl in graphed:
            outputs[impl].backward(upstream)
        torch.testing.assert_close(inputs["hierpar"].grad, inputs["stock"].grad, rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(converted.named_parameters(), stock.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
