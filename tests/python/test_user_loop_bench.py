"""bench/user_loop.py (pytorch/examples' DCGAN loop, stock against hierpar.nn.convert's models) on the CPU: its flags
refuse bad values in one line naming the flag, and one eager step of each impl runs and writes a record in
bench/results' format. The timings themselves need a GPU (bench/user_loop.py --device cuda)."""
import importlib.util
import json
import os

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "user_loop.py")


@pytest.fixture(scope="module")
def user_loop():
    spec = importlib.util.spec_from_file_location("user_loop", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,message", [
    (["--modes", "eager,fast"], "--modes: unknown mode 'fast' (choose from eager, bf16, compile, reduce_overhead)"),
    (["--impls", "ours"], "--impls: unknown impl 'ours' (choose from stock, hierpar)"),
    (["--batches", "64,x"], "--batches: expected batch sizes, got 'x'"),
    (["--batches", "0"], "--batches: expected positive batch sizes, got '0'"),
    (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected an integer >= 0, got -1"),
    (["--device", "cpu", "--modes", "reduce_overhead"], "--modes: reduce_overhead needs CUDA graphs"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_flags_fail_in_one_line(user_loop, capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        user_loop.parse_args(argv + (["--device", "cpu"] if "--device" not in argv else []))
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_no_cuda_fails_in_one_line(user_loop, capsys):
    with pytest.raises(SystemExit) as exit:
        user_loop.parse_args([])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.strip() == ("user_loop.py: no CUDA device: this benchmark times GPU steps (--device cpu runs a smoke "
                           "test)")


def test_one_eager_step_of_each_impl_writes_a_record(user_loop, tmp_path, capsys):
    assert user_loop.main(["--device", "cpu", "--batches", "2", "--modes", "eager", "--warmup", "0", "--steps", "1",
                           "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    with open(tmp_path / "cpu-user_loop-py.json") as f:
        doc = json.load(f)
    assert list(doc)[:7] == ["gpu", "gpus", "torch", "cuda", "commit", "date", "records"]
    assert [r["impl"] for r in doc["records"]] == ["stock", "hierpar"]
    for r in doc["records"]:
        assert r["bench"] == "user_loop"
        assert r["config"] == {"program": "py_dcgan", "batch": 2, "mode": "eager", "precision": "fp32"}
        assert r["repeats"] == 1 and 0 < r["min_us"] <= r["median_us"]
        assert r["graph_breaks"] is None and r["recompiles"] is None  # nothing compiled in eager mode
    assert "py_dcgan batch 2 eager fp32" in printed.out and "stock/hierpar" in printed.out
    assert "hierpar.nn.convert: 9 converted, 4 fused, 0 left" in printed.err  # the generator's report


def test_profile_writes_a_table_per_impl(user_loop, tmp_path):
    assert user_loop.main(["--device", "cpu", "--batches", "2", "--modes", "eager", "--warmup", "0", "--steps", "1",
                           "--out", str(tmp_path), "--profile", str(tmp_path / "profiles")]) == 0
    for impl in ("stock", "hierpar"):
        text = (tmp_path / "profiles" / f"2-eager-{impl}.txt").read_text()
        assert text.startswith(f"5 steps of {impl}") and "by host time:" in text
        assert ("hierpar::" in text) == (impl == "hierpar")


def test_models_are_the_programs(user_loop):
    """The bench's models have the program's parameter shapes (ngf = ndf = 64, nz = 100) and convert fully."""
    import hierpar
    netG, netD = user_loop.Generator(), user_loop.Discriminator()
    assert sum(p.numel() for p in netG.parameters()) == 3576704
    assert sum(p.numel() for p in netD.parameters()) == 2765568
    for net in (netG, netD):
        _, report = hierpar.nn.convert(net, report=True)
        assert report.left == [] and len(report.fused) in (3, 4)
