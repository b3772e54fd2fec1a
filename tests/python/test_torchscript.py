"""TorchScript both ways, with the same outputs on each side:
  1. a DCGAN generator built from hierpar.nn layers, scripted in Python and saved, then loaded and run from C++
     (tests/torchscript_run.cpp: torch::jit::load in a program linking libhierpar_ops);
  2. the generator that C++ exports (hierpar-dcgan export) loaded with torch.jit.load in Python and run, and
     compared with the same weights in hierpar.nn layers and with the C++ run of the same file.
The C++ programs come from the build tree: ctest passes their paths in HIERPAR_TORCHSCRIPT_RUN and HIERPAR_DCGAN.
"""
import os
import subprocess
from collections import OrderedDict

import pytest
import torch

import hierpar

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")

RUNNER = os.environ.get("HIERPAR_TORCHSCRIPT_RUN")
DCGAN = os.environ.get("HIERPAR_DCGAN")
needs_runner = pytest.mark.skipif(not RUNNER or not os.path.isfile(RUNNER),
                                  reason="HIERPAR_TORCHSCRIPT_RUN (the built hierpar_torchscript_run) not given")

# float32 on the same CPU kernels: Python and C++ call the same ops on the same data, so equal up to the
# thread count's effect on reduction order (none for these kernels in eval mode; the bound allows it).
RTOL, ATOL = 1e-5, 1e-6


class Generator(torch.nn.Sequential):
    """The C++ DCGAN generator's structure and parameter names (models/include/hierpar/models/dcgan.h):
    deconv1..L (kernel 4, no bias; the first 1 -> 4 with stride 1, the others double the size), bn1..L-1 each
    with its ReLU fused, tanh. `channels` lists nz, the hidden widths and the image channels."""

    def __init__(self, channels):
        layers = []
        for i in range(len(channels) - 1):
            first = i == 0
            layers.append((f"deconv{i + 1}", hierpar.nn.ConvTranspose2d(
                channels[i], channels[i + 1], 4, stride=1 if first else 2, padding=0 if first else 1, bias=False)))
            if i + 2 < len(channels):
                layers.append((f"bn{i + 1}", hierpar.nn.BatchNormAct2d(channels[i + 1], activation="relu")))
        super().__init__(OrderedDict(layers))
        self.nz = channels[0]

    def forward(self, z):
        x = z.reshape([z.size(0), self.nz, 1, 1])
        for layer in self:
            x = layer(x)
        return torch.tanh(x)

    @classmethod
    def from_state_dict(cls, state):
        """The generator whose deconv weights have these shapes, with these weights (strictly the same keys)."""
        deconvs = sorted((k for k in state if k.startswith("deconv") and k.endswith(".weight")),
                         key=lambda k: int(k[len("deconv"):-len(".weight")]))
        generator = cls([state[deconvs[0]].shape[0]] + [state[k].shape[1] for k in deconvs])
        generator.load_state_dict(state, strict=True)
        return generator


def run_in_cpp(module_path, z, tmp_path):
    torch.save(z, tmp_path / "input.pt")
    result = subprocess.run([RUNNER, str(module_path), str(tmp_path / "input.pt"), str(tmp_path / "output.pt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"hierpar_torchscript_run failed:\n{result.stdout}\n{result.stderr}"
    return torch.load(tmp_path / "output.pt")


def trained_a_little(generator, rng_steps=2):
    """Running statistics and weights away from their initial values (a few training-mode forwards)."""
    generator.train()
    with torch.no_grad():
        for p in generator.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for _ in range(rng_steps):
            generator(torch.randn(8, generator.nz))
    return generator.eval()


def test_script_keeps_the_ops_and_matches_eager(tmp_path):
    generator = trained_a_little(Generator([16, 32, 16, 8, 1]))
    scripted = torch.jit.script(generator)
    graph = str(scripted.inlined_graph)
    assert "hierpar::conv_transpose2d" in graph and "hierpar::batch_norm_act" in graph
    pool = torch.jit.script(hierpar.nn.MaxPool2d(3, 2, 1))
    assert "hierpar::max_pool2d" in str(pool.inlined_graph)
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(pool(x), torch.nn.functional.max_pool2d(x, 3, 2, 1), rtol=0, atol=0)
    scripted.save(str(tmp_path / "generator.pt"))
    loaded = torch.jit.load(str(tmp_path / "generator.pt"))
    z = torch.randn(5, 16)
    with torch.no_grad():
        expected = generator(z)
        torch.testing.assert_close(scripted(z), expected, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loaded(z), expected, rtol=RTOL, atol=ATOL)


@needs_runner
def test_python_scripted_generator_runs_in_cpp(tmp_path):
    generator = trained_a_little(Generator([16, 32, 16, 8, 3]))
    torch.jit.script(generator).save(str(tmp_path / "generator.pt"))
    z = torch.randn(4, 16)
    with torch.no_grad():
        expected = generator(z)
    torch.testing.assert_close(run_in_cpp(tmp_path / "generator.pt", z, tmp_path), expected, rtol=RTOL, atol=ATOL)


@needs_runner
@pytest.mark.skipif(not DCGAN or not os.path.isfile(DCGAN), reason="HIERPAR_DCGAN (the built hierpar-dcgan) not given")
def test_cpp_exported_generator_runs_in_python(tmp_path):
    out = tmp_path / "run"
    train = [DCGAN, "train", "--data", "synthetic", "--limit", "8", "--batch-size", "4", "--max-steps", "2",
             "--image-size", "32", "--width", "0.25", "--nz", "16", "--channels", "1", "--samples", "4",
             "--device", "cpu", "--layers", "hierpar", "--out", str(out)]
    for command in (train, [DCGAN, "export", "--checkpoint", str(out / "checkpoint.pt"),
                            "--output", str(tmp_path / "exported.pt"), "--layers", "hierpar"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    exported = torch.jit.load(str(tmp_path / "exported.pt"))
    for op in ("hierpar::conv_transpose2d", "hierpar::batch_norm_act"):
        assert op in str(exported.forward.graph), (
            f"the exported generator does not call {op}: was hierpar-dcgan built with hierpar's layers "
            f"(models/nn/)?\n{exported.code}")
    z = torch.randn(6, 16)
    with torch.no_grad():
        in_python = exported(z)
        same_weights = Generator.from_state_dict(exported.state_dict()).eval()(z)
    assert in_python.shape == (6, 1, 32, 32)
    torch.testing.assert_close(in_python, same_weights, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(run_in_cpp(tmp_path / "exported.pt", z, tmp_path), in_python, rtol=RTOL, atol=ATOL)
