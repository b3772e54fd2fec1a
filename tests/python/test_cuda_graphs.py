"""A converted model under PyTorch's own CUDA graph tools, used as their docs say: a whole training step captured with
torch.cuda.graph and replayed, and torch.cuda.make_graphed_callables, each against the same steps run eagerly. Needs a
GPU; skips without one."""
import copy

import pytest
import torch

import hierpar
from conftest import random_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


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
        # cuDNN may pick other (TF32) algorithms inside a capture than eagerly.
        torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-4, msg=lambda m: f"{name}: {m}")
    for (name, b), (_, c) in zip(actual.named_buffers(), expected.named_buffers()):
        torch.testing.assert_close(b, c, rtol=2e-3, atol=2e-4, msg=lambda m: f"buffer {name}: {m}")


def test_whole_step_captured_with_torch_cuda_graph_equals_eager_steps():
    device = torch.device("cuda")
    eager = small_generator().to(device)
    graphed = hierpar.nn.convert(copy.deepcopy(eager))
    x = random_tensor([6, 8, 1, 1], torch.float32, device)
    target = random_tensor([6, 3, 16, 16], torch.float32, device).tanh()
    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-2, capturable=True)
    graphed_opt = torch.optim.Adam(graphed.parameters(), lr=1e-2, capturable=True)
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
    torch.testing.assert_close(losses[-1], expected_loss, rtol=2e-3, atol=2e-4)
    assert not torch.equal(losses[0], losses[-1])  # the replays trained
    assert_parameters_close(graphed, eager)


def test_make_graphed_callables_gives_eager_outputs_and_gradients():
    device = torch.device("cuda")
    eager = small_generator().to(device)
    model = hierpar.nn.convert(copy.deepcopy(eager))
    sample = random_tensor([6, 8, 1, 1], torch.float32, device).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    for _ in range(2):
        x = random_tensor([6, 8, 1, 1], torch.float32, device)
        upstream = random_tensor([6, 3, 16, 16], torch.float32, device)
        x_graphed, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_graphed, out_eager = graphed(x_graphed), eager(x_eager)
        torch.testing.assert_close(out_graphed, out_eager, rtol=2e-3, atol=2e-4)
        out_graphed.backward(upstream)
        out_eager.backward(upstream)
        torch.testing.assert_close(x_graphed.grad, x_eager.grad, rtol=2e-3, atol=2e-4)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-4, msg=lambda m: f"grad of {name}: {m}")
