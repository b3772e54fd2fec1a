"""hierpar.nn.convert on the DCGAN of pytorch/examples (dcgan/main.py: nn.Sequential models with in-place
activations, BCELoss on a Sigmoid, Adam) and on other module trees: the converted model keeps the same parameter and
buffer objects (state_dict, optimizers), computes what the stock model computes (float64, forward and backward, train
and eval), fuses BatchNorm2d + ReLU/LeakyReLU inside a Sequential, and reports what it converted, fused and left."""
import copy

import pytest
import torch
import torch.nn as nn

import hierpar
from conftest import random_tensor

RTOL, ATOL = 1e-9, 1e-9


# ---- the models of pytorch/examples' dcgan/main.py ----------------------------------------------------------

class Generator(nn.Module):
    """nz -> 4x4 -> 8x8 -> 16x16 -> 32x32 -> 64x64 images of nc channels: ConvTranspose2d (kernel 4, no bias),
    BatchNorm2d and ReLU(True) per stage, Tanh at the end, in self.main (a Sequential)."""

    def __init__(self, nz=16, ngf=8, nc=3):
        super().__init__()
        widths = [ngf * 8, ngf * 4, ngf * 2, ngf]
        layers = [nn.ConvTranspose2d(nz, widths[0], 4, 1, 0, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(True)]
        for c_in, c_out in zip(widths, widths[1:]):
            layers += [nn.ConvTranspose2d(c_in, c_out, 4, 2, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True)]
        layers += [nn.ConvTranspose2d(widths[-1], nc, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    """64x64 images of nc channels -> a probability per image: Conv2d (kernel 4, no bias) and LeakyReLU(0.2,
    inplace=True) per stage, BatchNorm2d in all stages but the first, a 4x4 Conv2d to one channel and Sigmoid."""

    def __init__(self, ndf=8, nc=3):
        super().__init__()
        widths = [ndf, ndf * 2, ndf * 4, ndf * 8]
        layers = [nn.Conv2d(nc, widths[0], 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        for c_in, c_out in zip(widths, widths[1:]):
            layers += [nn.Conv2d(c_in, c_out, 4, 2, 1, bias=False), nn.BatchNorm2d(c_out),
                       nn.LeakyReLU(0.2, inplace=True)]
        layers += [nn.Conv2d(widths[-1], 1, 4, 1, 0, bias=False), nn.Sigmoid()]
        self.main = nn.Sequential(*layers)

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def dcgan_init(module):
    """The program's initialisation: convolution weights N(0, 0.02), batch-norm weights N(1, 0.02), biases 0."""
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def dcgan(dtype=torch.float64, nz=16):
    netG, netD = Generator(nz=nz), Discriminator()
    for net in (netG, netD):
        net.apply(dcgan_init)
        net.to(dtype)
    return netG, netD


G_CONVERTED = ([(f"main.{i}", "torch.nn.ConvTranspose2d", "hierpar.nn.ConvTranspose2d") for i in (0, 3, 6, 9, 12)]
               + [(f"main.{i}", "torch.nn.BatchNorm2d", "hierpar.nn.BatchNormAct2d") for i in (1, 4, 7, 10)])
G_FUSED = [(f"main.{i}", f"main.{i + 1}") for i in (1, 4, 7, 10)]
D_CONVERTED = ([(f"main.{i}", "torch.nn.Conv2d", "hierpar.nn.Conv2d") for i in (0, 2, 5, 8, 11)]
               + [(f"main.{i}", "torch.nn.BatchNorm2d", "hierpar.nn.BatchNormAct2d") for i in (3, 6, 9)])
D_FUSED = [(f"main.{i}", f"main.{i + 1}") for i in (3, 6, 9)]


def check_same_computation(converted, stock, inputs, what, steps=1):
    """Forward and backward (a random upstream gradient) of both models on copies of each input: outputs, input
    gradients, parameter gradients and, after each step, buffers (running statistics) agree."""
    for step in range(steps):
        x = inputs()
        x_c, x_s = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_s = converted(x_c), stock(x_s)
        torch.testing.assert_close(out_c, out_s, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} step {step}: output: {m}")
        upstream = torch.randn_like(out_s)
        out_c.backward(upstream)
        out_s.backward(upstream)
        torch.testing.assert_close(x_c.grad, x_s.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} step {step}: grad_input: {m}")
        for (name, p_c), (_, p_s) in zip(converted.named_parameters(), stock.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_s.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what} step {step}: grad of {name}: {m}")
            p_c.grad, p_s.grad = None, None
        for (name, b_c), (_, b_s) in zip(converted.named_buffers(), stock.named_buffers()):
            torch.testing.assert_close(b_c, b_s, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what} step {step}: buffer {name}: {m}")


def noise(batch, nz=16):
    return lambda: random_tensor([batch, nz, 1, 1], torch.float64)


def images(batch):
    return lambda: random_tensor([batch, 3, 64, 64], torch.float64)


# ---- the DCGAN ----------------------------------------------------------------------------------------------

def test_dcgan_keeps_parameters_buffers_and_state_dict():
    for net in dcgan():
        params, buffers = list(net.parameters()), list(net.buffers())
        before = {key: value.clone() for key, value in net.state_dict().items()}
        converted = hierpar.nn.convert(net)
        assert converted is net  # the root is a user module: converted in place
        assert all(a is b for a, b in zip(converted.parameters(), params)) and len(params) == len(
            list(converted.parameters()))
        assert all(a is b for a, b in zip(converted.buffers(), buffers)) and len(buffers) == len(
            list(converted.buffers()))
        after = converted.state_dict()
        assert list(after.keys()) == list(before.keys())
        for key, value in before.items():
            assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
        assert not any(type(m) in (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d) for m in converted.modules())


def test_dcgan_report_lists_converted_and_fused_layers():
    netG, netD = dcgan()
    netG, report_g = hierpar.nn.convert(netG, report=True)
    netD, report_d = hierpar.nn.convert(netD, report=True)
    assert isinstance(report_g, hierpar.nn.ConversionReport)
    assert sorted(report_g.converted) == sorted(G_CONVERTED) and report_g.fused == G_FUSED and report_g.left == []
    assert sorted(report_d.converted) == sorted(D_CONVERTED) and report_d.fused == D_FUSED and report_d.left == []
    for i in (2, 5, 8, 11):
        assert type(netG.main[i]) is nn.Identity
    for i, slope in ((4, 0.2), (7, 0.2), (10, 0.2)):
        assert type(netD.main[i]) is nn.Identity
        assert netD.main[i - 1].activation == "leaky_relu" and netD.main[i - 1].negative_slope == slope
    assert type(netD.main[1]) is nn.LeakyReLU  # after a Conv2d: not a batch norm's activation
    assert all(netG.main[i].activation == "relu" for i in (1, 4, 7, 10))
    text = str(report_d)
    assert text.splitlines()[0] == "hierpar.nn.convert: 8 converted, 3 fused, 0 left"
    rows = [line.split() for line in text.splitlines()]
    assert ["main.0", "torch.nn.Conv2d", "->", "hierpar.nn.Conv2d"] in rows
    assert ["main.3", "+", "main.4"] in rows


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_dcgan_computes_what_stock_computes(training):
    stock_g, stock_d = dcgan()
    if not training:  # running statistics away from their initial values
        with torch.no_grad():
            stock_g(noise(8)())
            stock_d(images(8)())
    stock_g.train(training), stock_d.train(training)
    netG, netD = hierpar.nn.convert(copy.deepcopy(stock_g)), hierpar.nn.convert(copy.deepcopy(stock_d))
    assert netG.training == training and all(m.training == training for m in netD.modules())
    what = "train" if training else "eval"
    check_same_computation(netG, stock_g, noise(3), f"Generator {what}", steps=2)
    check_same_computation(netD, stock_d, images(2), f"Discriminator {what}", steps=2)
    check_same_computation(netD, stock_d, images(1), f"Discriminator {what}, batch 1")


def dcgan_iteration(netG, netD, optimizerG, optimizerD, real, z):
    """One iteration of the program's loop: D on the real batch (label 1) and on G's fake batch (label 0), D's step;
    G's loss through D (label 1), G's step. Returns the three losses."""
    criterion = nn.BCELoss()
    label = torch.full((real.shape[0],), 1.0, dtype=real.dtype)
    netD.zero_grad()
    errD_real = criterion(netD(real), label)
    errD_real.backward()
    fake = netG(z)
    errD_fake = criterion(netD(fake.detach()), label.fill_(0.0))
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    errG = criterion(netD(fake), label.fill_(1.0))
    errG.backward()
    optimizerG.step()
    return errD_real.detach(), errD_fake.detach(), errG.detach()


def test_adam_built_before_conversion_trains_the_converted_models():
    netG, netD = dcgan()
    stock_g, stock_d = copy.deepcopy(netG), copy.deepcopy(netD)
    adam = dict(lr=2e-4, betas=(0.5, 0.999))
    optimizerG, optimizerD = torch.optim.Adam(netG.parameters(), **adam), torch.optim.Adam(netD.parameters(), **adam)
    stock_optimizers = torch.optim.Adam(stock_g.parameters(), **adam), torch.optim.Adam(stock_d.parameters(), **adam)
    netG, netD = hierpar.nn.convert(netG), hierpar.nn.convert(netD)
    initial = [p.detach().clone() for p in netD.parameters()]
    for step in range(2):
        real, z = random_tensor([3, 3, 64, 64], torch.float64), random_tensor([3, 16, 1, 1], torch.float64)
        losses = dcgan_iteration(netG, netD, optimizerG, optimizerD, real, z)
        stock_losses = dcgan_iteration(stock_g, stock_d, *stock_optimizers, real, z)
        for name, a, b in zip(("errD_real", "errD_fake", "errG"), losses, stock_losses):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}: {name}: {m}")
    assert all(not torch.equal(p, q) for p, q in zip(netD.parameters(), initial)), "D's parameters did not change"
    for converted, stock in ((netG, stock_g), (netD, stock_d)):
        for (name, p), (_, q) in zip(converted.state_dict().items(), stock.state_dict().items()):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name} after two steps: {m}")


# ---- other module trees ---------------------------------------------------------------------------------------

class Block(nn.Module):
    """Layers held as attributes and called in forward (no Sequential): nothing is fused."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(5)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.up = nn.ConvTranspose2d(5, 4, 3, stride=2, padding=1, output_padding=1)
        self.head = nn.Conv2d(4, 2, 3, padding="same")

    def forward(self, x):
        return self.head(self.up(self.pool(self.act(self.bn(self.conv(x))))))


def test_user_module_with_layers_as_attributes():
    stock = Block().double()
    net, report = hierpar.nn.convert(copy.deepcopy(stock), report=True)
    assert type(net.conv) is hierpar.nn.Conv2d and net.conv.padding_mode == "reflect"
    assert type(net.bn) is hierpar.nn.BatchNorm2d and type(net.act) is nn.ReLU
    assert type(net.pool) is hierpar.nn.MaxPool2d and type(net.up) is hierpar.nn.ConvTranspose2d
    assert type(net.head) is hierpar.nn.Conv2d and net.head.padding == "same"
    assert [name for name, _, _ in report.converted] == ["conv", "bn", "pool", "up", "head"]
    assert report.fused == [] and report.left == []
    # The ReLU(inplace=True) after hierpar's BatchNorm2d: its backward works (the batch norm keeps its input).
    check_same_computation(net, stock, lambda: random_tensor([2, 3, 7, 9], torch.float64), "Block", steps=2)


def test_batch_norm_and_relu_across_a_sequential_boundary_are_converted_not_fused():
    stock = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
                          nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))).double()
    net, report = hierpar.nn.convert(copy.deepcopy(stock), report=True)
    assert type(net[0][1]) is hierpar.nn.BatchNorm2d and type(net[1][0]) is nn.ReLU
    assert report.fused == [] and report.left == []
    assert sorted(name for name, _, _ in report.converted) == ["0.0", "0.1", "1.1"]
    check_same_computation(net, stock, lambda: random_tensor([2, 3, 6, 5], torch.float64), "across Sequentials")


def test_fused_pairs_and_the_ones_left():
    """Fused: ReLU (inplace or not), LeakyReLU(inplace=True), LeakyReLU(inplace=False) before a convolution. Left as
    they are (the batch norm still converted): a LeakyReLU with slope <= 0, a LeakyReLU(inplace=False) that ends the
    Sequential or precedes an in-place module, an activation with a hook."""
    hooked = nn.ReLU()
    hooked.register_forward_hook(lambda module, args, output: None)
    layers = [
        nn.BatchNorm2d(3), nn.ReLU(),  # 0, 1: fused
        nn.BatchNorm2d(3), nn.LeakyReLU(0.1, inplace=True),  # 2, 3: fused
        nn.BatchNorm2d(3), nn.LeakyReLU(-0.1),  # 4, 5: slope <= 0
        nn.BatchNorm2d(3), nn.LeakyReLU(0.0, inplace=True),  # 6, 7: slope <= 0
        nn.BatchNorm2d(3), nn.LeakyReLU(0.3), nn.Conv2d(3, 3, 1),  # 8, 9, 10: fused (the conv only reads it)
        nn.BatchNorm2d(3), nn.LeakyReLU(0.3), nn.ReLU(inplace=True),  # 11, 12, 13: not fused (13 writes it)
        nn.BatchNorm2d(3), hooked,  # 14, 15: a hook
        nn.BatchNorm2d(3), nn.LeakyReLU(0.25),  # 16, 17: ends the Sequential
    ]
    stock = nn.Sequential(*layers).double()
    net, report = hierpar.nn.convert(copy.deepcopy(stock), report=True)
    assert report.fused == [("0", "1"), ("2", "3"), ("8", "9")]
    assert [name for name, _, _ in report.left] == ["5", "7", "12", "15", "17"]
    reasons = {name: reason for name, _, reason in report.left}
    assert "negative_slope -0.1 <= 0" in reasons["5"] and "inverting the LeakyReLU" in reasons["5"]
    assert "negative_slope 0.0 <= 0" in reasons["7"]
    assert "torch.nn.ReLU" in reasons["12"] and "may modify it in place" in reasons["12"]
    assert "hooks (forward_hooks)" in reasons["15"]
    assert "the Sequential's caller" in reasons["17"]
    for i in (4, 6, 11, 14, 16):
        assert type(net[i]) is hierpar.nn.BatchNorm2d, i
    assert [type(net[i]) for i in (1, 3, 9)] == [nn.Identity] * 3
    assert (net[0].activation, net[2].activation, net[2].negative_slope) == ("relu", "leaky_relu", 0.1)
    check_same_computation(net, stock, lambda: random_tensor([2, 3, 5, 4], torch.float64), "fused and left", steps=2)
    text = str(report)
    assert "left:" in text and "negative_slope -0.1 <= 0" in text


def test_fuse_activations_false_and_batch_norm_options():
    """Every BatchNorm2d option that hierpar's layer reproduces converts (affine=False, track_running_stats=False,
    momentum=None); with fuse_activations=False the activations stay."""
    stock = nn.Sequential(nn.BatchNorm2d(3, affine=False), nn.ReLU(inplace=True),
                          nn.BatchNorm2d(3, track_running_stats=False), nn.LeakyReLU(0.2, inplace=True),
                          nn.BatchNorm2d(3, momentum=None, eps=1e-3), nn.ReLU()).double()
    for fuse in (False, True):
        net, report = hierpar.nn.convert(copy.deepcopy(stock), fuse_activations=fuse, report=True)
        assert len(report.converted) == 3 and report.left == []
        assert report.fused == ([("0", "1"), ("2", "3"), ("4", "5")] if fuse else [])
        assert [net[i].affine for i in (0, 2, 4)] == [False, True, True]
        assert net[2].track_running_stats is False and net[4].momentum is None and net[4].eps == 1e-3
        check_same_computation(net, stock, lambda: random_tensor([2, 3, 4, 5], torch.float64),
                               f"fuse_activations={fuse}", steps=3)


def test_root_layer_is_replaced_and_shared_layers_stay_shared():
    conv = nn.Conv2d(3, 4, 3)
    converted, report = hierpar.nn.convert(conv, report=True)
    assert type(converted) is hierpar.nn.Conv2d and converted is not conv and converted.weight is conv.weight
    assert report.converted == [("", "torch.nn.Conv2d", "hierpar.nn.Conv2d")]
    assert "(root)" in str(report)
    shared = nn.ConvTranspose2d(2, 2, 3, padding=1)
    net = hierpar.nn.convert(nn.Sequential(shared, nn.Tanh(), shared))
    assert type(net[0]) is hierpar.nn.ConvTranspose2d and net[0] is net[2]


def test_conversion_keeps_device_dtype_requires_grad_and_attributes():
    stock = nn.Sequential(nn.Conv2d(3, 4, 3, dtype=torch.bfloat16), nn.BatchNorm2d(4), nn.MaxPool2d(3, 2, 1)).eval()
    stock[0].weight.requires_grad_(False)
    stock[0].qconfig = "kept"
    net = hierpar.nn.convert(stock)
    assert net[0].weight.dtype == torch.bfloat16 and not net[0].weight.requires_grad and net[0].qconfig == "kept"
    assert all(not m.training for m in net.modules())
    assert (net[2].kernel_size, net[2].stride, net[2].padding) == (3, 2, 1)


class MyConv(nn.Conv2d):
    pass


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")
def test_what_is_left_and_why():
    parametrized = nn.Conv2d(3, 3, 1)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    hooked = nn.BatchNorm2d(3)
    hooked.register_forward_pre_hook(lambda module, args: None)
    scripted = torch.jit.script(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()))
    model = nn.Sequential(MyConv(3, 3, 1), parametrized, hooked, nn.MaxPool2d(17), scripted,
                          hierpar.nn.Conv2d(3, 3, 1), nn.SyncBatchNorm(3), nn.Conv2d(3, 3, 1, dtype=torch.complex64))
    net, report = hierpar.nn.convert(model, report=True)
    assert report.converted == [] and report.fused == []
    left = {name: (kind, reason) for name, kind, reason in report.left}
    assert sorted(left) == ["0", "1", "2", "3", "4.0", "5", "6", "7"], report.left
    assert "a subclass of torch.nn.Conv2d" in left["0"][1]
    assert "parametrized" in left["1"][1]
    assert "hooks (forward_pre_hooks)" in left["2"][1]
    assert "289 elements per window" in left["3"][1]
    assert left["4.0"][0] == "torch.jit.ScriptModule (Conv2d)" and "convert before torch.jit.script" in left["4.0"][1]
    assert "already a hierpar.nn layer" in left["5"][1]
    assert "SyncBatchNorm" in left["6"][1]
    assert "torch.complex64" in left["7"][1]
    assert type(net[0]) is MyConv and type(net[2]) is nn.BatchNorm2d and type(net[3]) is nn.MaxPool2d


def test_inplace_false_converts_a_copy():
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(True))
    net = hierpar.nn.convert(stock, inplace=False)
    assert net is not stock and [type(m) for m in stock] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    assert [type(m) for m in net] == [hierpar.nn.Conv2d, hierpar.nn.BatchNormAct2d, nn.Identity]
    assert net[0].weight is not stock[0].weight and torch.equal(net[0].weight, stock[0].weight)


def test_convert_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="hierpar.nn.convert: module: expected a torch.nn.Module, got list"):
        hierpar.nn.convert([nn.Conv2d(3, 3, 1)])
