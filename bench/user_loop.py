"""A user's training loop, timed: PyTorch's canonical DCGAN (pytorch/examples, dcgan/main.py) with its own models and
loop body, once on torch.nn's layers (impl "stock") and once on the same models passed through hierpar.nn.convert
(impl "hierpar"), measured in one process, alternating step by step.

The models are the program's: a generator nz=100 -> 64x64x3 (ConvTranspose2d, BatchNorm2d, ReLU(True), Tanh) and a
discriminator 64x64x3 -> a probability (Conv2d, BatchNorm2d, LeakyReLU(0.2, inplace=True), Sigmoid), ngf = ndf = 64,
its weight initialisation, BCELoss, Adam(lr 2e-4, betas (0.5, 0.999)), labels real 1 and fake 0. One step is the
program's loop body: D on a real batch, G's fake batch through D (detached), D's step, then G through D and G's step.
The data are random images in [-1, 1), generated on the device before timing (the program's data loader and its
host-to-device copy are left out), and fresh noise each step as the program draws it.

Modes (each a config, for every batch size):
  eager            the loop as written, float32 (cuDNN's TF32 setting left at torch's default, recorded per record);
  bf16             torch.autocast(bfloat16) around each forward and loss; D's Sigmoid dropped and BCEWithLogitsLoss
                   used instead (autocast refuses BCELoss);
  compile          torch.compile(netG), torch.compile(netD) (default mode);
  reduce_overhead  torch.compile(mode="reduce-overhead") on both, torch.compiler.cudagraph_mark_step_begin() at the
                   start of each step.
Compilation happens in the warm-up steps. For the compile modes each record also holds the graph breaks, the
recompilations and the graphs dynamo compiled for that impl (torch._dynamo's counters and its "recompiles" log), and
for reduce_overhead the CUDA graph trees' skips.

Each step is timed with CUDA events (on --device cpu, a smoke-test mode, with the wall clock); the records (median
and minimum per step) go to DIR/<gpu>-user_loop.json in bench/results' format (/work/shared/BENCH_FORMAT.md: bench
"user_loop", config {program, batch, mode, precision}) and a table with the ratio stock/hierpar is printed.

Runs with torch and hierpar alone (no network): hierpar is the installed package, or bindings/ of this checkout when
HIERPAR_OPS_LIBRARY names a built libhierpar_ops.so.

    HIERPAR_OPS_LIBRARY=build/libhierpar_ops.so python bench/user_loop.py --batches 64,256 --steps 50
"""
import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("eager", "bf16", "compile", "reduce_overhead")
IMPLS = ("stock", "hierpar")
COMPILE_MODES = {"compile": "default", "reduce_overhead": "reduce-overhead"}
NZ, NGF, NDF, NC = 100, 64, 64, 3
PROG = os.path.basename(__file__)


def fail(message):
    print(f"{PROG}: {message}", file=sys.stderr)
    sys.exit(2)


def import_hierpar():
    if os.environ.get("HIERPAR_OPS_LIBRARY"):
        sys.path.insert(0, os.path.join(ROOT, "bindings"))
    try:
        import hierpar
    except ImportError as error:
        fail(f"cannot import hierpar ({error}): install it (pip install ./bindings) or set HIERPAR_OPS_LIBRARY to a "
             "built libhierpar_ops.so")
    return hierpar


# ---- the program's models and initialisation -------------------------------------------------------------------

class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 8), nn.ReLU(True),  # 4x4
            nn.ConvTranspose2d(NGF * 8, NGF * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF * 4), nn.ReLU(True),  # 8x8
            nn.ConvTranspose2d(NGF * 4, NGF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF * 2), nn.ReLU(True),  # 16
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF), nn.ReLU(True),  # 32x32
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh(),  # 64x64
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    """With sigmoid=False the last Sigmoid is left out (logits, for BCEWithLogitsLoss under autocast)."""

    def __init__(self, sigmoid=True):
        super().__init__()
        layers = [
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),  # 32x32
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 4), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, NDF * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 8), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False),  # 1x1
        ]
        if sigmoid:
            layers.append(nn.Sigmoid())
        self.main = nn.Sequential(*layers)

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def weights_init(module):
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def with_own_forward(cls, tag):
    """A subclass of cls whose forward is a copy with a code object of its own. dynamo keys its compiled code by code
    object, so each impl's models compile as they would in a process of their own: without this the second impl's
    first call counts as a recompilation of the first impl's forward and shares its recompile limit."""
    f = cls.forward
    code = f.__code__.replace(co_qualname=f"{cls.__qualname__}.forward[{tag}]")
    forward = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


# ---- one impl of one config --------------------------------------------------------------------------------------

class Counts:
    """dynamo's graph breaks, recompilations and compiled graphs, and the CUDA graph trees' skips, read around calls
    (the counters are process-wide: each impl adds what changed during its own steps)."""

    def __init__(self):
        self.recompile_messages = []
        handler = logging.Handler()
        handler.emit = lambda record: self.recompile_messages.append(record.getMessage())
        torch._logging.set_logs(recompiles=True)
        logger = logging.getLogger("torch._dynamo.guards.__recompiles")
        logger.addHandler(handler)  # torch's own handler prints each reason too (stderr)

    def snapshot(self):
        from torch._dynamo.utils import counters
        return (sum(counters["graph_break"].values()), len(self.recompile_messages),
                counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"])


class Run:
    """One impl of one config: its models, optimizers and the loop body as a step() callable."""

    def __init__(self, impl, mode, batch, device, hierpar, seed):
        torch.manual_seed(seed)  # the same weights, data and noise for both impls
        self.impl, self.mode, self.device = impl, mode, device
        netG = with_own_forward(Generator, impl)().to(device)
        netD = with_own_forward(Discriminator, impl)(sigmoid=mode != "bf16").to(device)
        netG.apply(weights_init)
        netD.apply(weights_init)
        self.report = None
        if impl == "hierpar":
            netG, report_g = hierpar.nn.convert(netG, report=True)
            netD, report_d = hierpar.nn.convert(netD, report=True)
            self.report = (report_g, report_d)
        self.optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.netG_module, self.netD_module = netG, netD
        if mode in COMPILE_MODES:
            netG = torch.compile(netG, mode=COMPILE_MODES[mode])
            netD = torch.compile(netD, mode=COMPILE_MODES[mode])
        self.netG, self.netD = netG, netD
        self.criterion = nn.BCEWithLogitsLoss() if mode == "bf16" else nn.BCELoss()
        self.reals = [torch.rand(batch, NC, 64, 64, device=device) * 2 - 1 for _ in range(4)]
        self.batch = batch
        self.steps_done = 0
        self.breaks = self.recompiles = self.graphs = self.cudagraph_skips = 0

    def step(self):
        if self.mode == "reduce_overhead":
            torch.compiler.cudagraph_mark_step_begin()
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mode == "bf16")
        netG, netD, criterion = self.netG, self.netD, self.criterion
        real = self.reals[self.steps_done % len(self.reals)]
        self.steps_done += 1
        netD.zero_grad()
        label = torch.full((self.batch,), 1.0, dtype=torch.float32, device=self.device)
        with autocast:
            errD_real = criterion(netD(real), label)
        errD_real.backward()
        noise = torch.randn(self.batch, NZ, 1, 1, device=self.device)
        with autocast:
            fake = netG(noise)
            errD_fake = criterion(netD(fake.detach()), label.fill_(0.0))
        errD_fake.backward()
        self.optimizerD.step()
        netG.zero_grad()
        with autocast:
            errG = criterion(netD(fake), label.fill_(1.0))
        errG.backward()
        self.optimizerG.step()
        return errD_real, errD_fake, errG

    def counted_step(self, counts):
        if counts is None:  # nothing compiled
            return self.step()
        before = counts.snapshot()
        losses = self.step()
        after = counts.snapshot()
        self.breaks += after[0] - before[0]
        self.recompiles += after[1] - before[1]
        self.graphs += after[2] - before[2]
        self.cudagraph_skips += after[3] - before[3]
        return losses


class Timer:
    """Per-step time: CUDA events on the current stream (read once all steps are queued), or the wall clock on the
    CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pending = []

    def time(self, call):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            self.pending.append((start, end))
            return lambda: start.elapsed_time(end) * 1000.0
        begin = time.perf_counter()
        call()
        elapsed = (time.perf_counter() - begin) * 1e6
        return lambda: elapsed


def measure(config, args, device, hierpar, counts):
    """Warm-up, then args.steps timed steps of each impl, alternating (the impl that goes first alternates too).
    Returns {impl: (Run, [us per step])}."""
    torch._dynamo.reset()
    runs = {impl: Run(impl, config["mode"], config["batch"], device, hierpar, args.seed) for impl in args.impls}
    for run in runs.values():
        for _ in range(args.warmup):
            run.counted_step(counts)
        losses = run.counted_step(counts)  # one more, checked
        if not all(torch.isfinite(loss).item() for loss in losses):
            raise RuntimeError(f"{run.impl} {config}: a loss is not finite after the warm-up: {losses}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    timer = Timer(device)
    readings = {impl: [] for impl in runs}
    order = list(runs)
    for i in range(args.steps):
        for impl in (order if i % 2 == 0 else order[::-1]):
            readings[impl].append(timer.time(lambda: runs[impl].counted_step(counts)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    if args.profile:
        for impl, run in runs.items():
            profile(run, config, args, counts)
    return {impl: (runs[impl], [read() for read in readings[impl]]) for impl in runs}


def profile(run, config, args, counts, steps=5):
    """What `steps` more steps of `run` spend, by operator (host time) and by kernel (GPU time), as tables in
    args.profile/<batch>-<mode>-<impl>.txt."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            run.counted_step(counts)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    averages = prof.key_averages()
    os.makedirs(args.profile, exist_ok=True)
    path = os.path.join(args.profile, f"{config['batch']}-{config['mode']}-{run.impl}.txt")
    with open(path, "w") as f:
        f.write(f"{steps} steps of {run.impl}, {config}\n\nby host time:\n")
        f.write(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        if run.device.type == "cuda":
            f.write("\nby GPU time:\n")
            f.write(averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    print(f"{PROG}: profile of {run.impl} written to {path}", file=sys.stderr)


# ---- output --------------------------------------------------------------------------------------------------------

def commit():
    if os.environ.get("HIERPAR_COMMIT"):
        return os.environ["HIERPAR_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "none"


def file_name(device):
    """Named after the GPU (bench/results' convention): "NVIDIA H200" -> h200-user_loop-py.json (hierpar-bench's
    C++ suite writes h200-user_loop.json)."""
    if device.type != "cuda":
        return "cpu-user_loop-py.json"
    words = [w for w in gpu_name(device).split() if w.lower() != "nvidia"] or ["gpu"]
    return "".join(c for c in words[0].lower() if c.isalnum() or c == "-") + "-user_loop-py.json"


def record(config, run, times, args, device):
    rec = {"bench": "user_loop", "impl": run.impl, "config": config,
           "median_us": round(statistics.median(times), 2), "min_us": round(min(times), 2), "repeats": len(times),
           "graph_breaks": run.breaks if run.mode in COMPILE_MODES else None,
           "recompiles": run.recompiles if run.mode in COMPILE_MODES else None}
    if run.mode in COMPILE_MODES:
        rec["graphs"] = run.graphs
    if run.mode == "reduce_overhead":
        rec["cudagraph_skips"] = run.cudagraph_skips
    rec["warmup"] = args.warmup
    rec["cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
    rec["images_per_s"] = round(config["batch"] / (statistics.median(times) * 1e-6), 1)
    return rec


def write(records, args, device):
    doc = {"gpu": gpu_name(device), "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
           "torch": torch.__version__, "cuda": torch.version.cuda or "none", "commit": commit(),
           "date": datetime.date.today().isoformat(), "records": records}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, file_name(device))
    with open(path + ".tmp", "w") as f:  # one record per line, as bench/results' files read
        f.write("{\n")
        for key in ("gpu", "gpus", "torch", "cuda", "commit", "date"):
            f.write(f"  {json.dumps(key)}: {json.dumps(doc[key])},\n")
        f.write('  "records": [\n')
        f.write(",\n".join("    " + json.dumps(r) for r in records))
        f.write("\n  ]\n}\n")
    os.replace(path + ".tmp", path)
    return path


def table(records):
    """Per config: each impl's median and minimum ms per step, the ratio of the medians stock/hierpar, and for the
    compile modes the graph breaks and recompilations of each impl."""
    rows = {}
    for r in records:
        c = r["config"]
        rows.setdefault((c["batch"], c["mode"], c["precision"]), {})[r["impl"]] = r
    lines = [f"{'config':<42}{'stock ms med/min':>18}{'hierpar ms med/min':>20}{'stock/hierpar':>15}"
             f"{'breaks s/h':>12}{'recompiles s/h':>16}", "-" * 123]
    for (batch, mode, precision), impls in rows.items():
        def ms(impl, key="median_us"):
            return impls[impl][key] / 1000 if impl in impls else float("nan")

        def times(impl):
            return f"{ms(impl):.3f}/{ms(impl, 'min_us'):.3f}"

        def pair(key):
            values = [impls[i].get(key) if i in impls else None for i in IMPLS]
            return "-" if all(v is None for v in values) else "/".join("-" if v is None else str(v) for v in values)

        label = f"py_dcgan batch {batch} {mode} {precision}"
        lines.append(f"{label:<42}{times('stock'):>18}{times('hierpar'):>20}{ms('stock') / ms('hierpar'):>14.2f}x"
                     f"{pair('graph_breaks'):>12}{pair('recompiles'):>16}")
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, naming the flag
        fail(f"{message} (see --help)")


def listed(kind, allowed=None, convert=str):
    def parse(text):
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind}, got {text!r}")
        values = []
        for item in items:
            try:
                value = convert(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {kind}, got {item!r}") from None
            if allowed is not None and value not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {kind[:-1]} {item!r} (choose from {', '.join(allowed)})")
            if convert is int and value <= 0:
                raise argparse.ArgumentTypeError(f"expected positive {kind}, got {item!r}")
            values.append(value)
        return list(dict.fromkeys(values))
    return parse


def counted(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def parse_args(argv):
    parser = Parser(prog=PROG, description="Times pytorch/examples' DCGAN loop on torch.nn (stock) and on the same "
                                           "models through hierpar.nn.convert (hierpar).")
    parser.add_argument("--batches", type=listed("batch sizes", convert=int), default=[64, 256],
                        help="comma-separated batch sizes (default 64,256)")
    parser.add_argument("--modes", type=listed("modes", MODES), default=list(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default all)")
    parser.add_argument("--impls", type=listed("impls", IMPLS), default=list(IMPLS),
                        help="comma-separated, of stock, hierpar (default both)")
    parser.add_argument("--warmup", type=counted(0), default=10, help="untimed steps per impl first (default 10)")
    parser.add_argument("--steps", type=counted(1), default=50, help="timed steps per impl (default 50)")
    parser.add_argument("--seed", type=counted(0), default=0, help="weights, data and noise (default 0)")
    parser.add_argument("--out", default=os.environ.get("HIERPAR_BENCH_OUT") or
                        os.path.join(os.path.expanduser("~"), ".cache", "hierpar", "bench"),
                        help="folder for the JSON record (default $HIERPAR_BENCH_OUT, else ~/.cache/hierpar/bench, as "
                             "hierpar-bench; copy a record worth keeping into bench/results)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="after timing, profile 5 more steps of each impl into DIR (host and GPU time tables)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; the benchmark) or cpu (a smoke run, timed with the wall clock)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: no CUDA device: this benchmark times GPU steps (--device cpu runs a smoke test)",
              file=sys.stderr)
        sys.exit(1)
    if args.device == "cpu" and "reduce_overhead" in args.modes:
        fail("--modes: reduce_overhead needs CUDA graphs, which --device cpu has not")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    hierpar = import_hierpar()
    device = torch.device(args.device)
    counts = Counts() if any(mode in COMPILE_MODES for mode in args.modes) else None
    records = []
    for batch in args.batches:
        for mode in args.modes:
            config = {"program": "py_dcgan", "batch": batch, "mode": mode,
                      "precision": "bf16" if mode == "bf16" else "fp32"}
            print(f"{PROG}: batch {batch}, {mode}: {args.warmup} warm-up + {args.steps} timed steps per impl",
                  file=sys.stderr, flush=True)
            for impl, (run, times) in measure(config, args, device, hierpar, counts).items():
                records.append(record(config, run, times, args, device))
                if run.report is not None and batch == args.batches[0] and mode == args.modes[0]:
                    for report in run.report:
                        print(report, file=sys.stderr)
    path = write(records, args, device)
    print(table(records))
    print(f"records: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
