"""The cuda chip end to end on an NVIDIA GPU, against plain CUDA: results checked, times compared.

    python benchmarks/gpu_check.py [--quick] [--json PATH] [--modes device,native]
                                   [--checks ddpm,bert,train,compile,attention] [--dry-run]

For each flagos mode (device: tensors on `flagos:0` with CUDA payloads; native: tensors stay
`cuda:0` and flagos routes every op through its dispatch mode), in a child process of its own
(a process activates flagos one way only), five checks run against plain PyTorch on CUDA in
that same process:

    ddpm     a Diffusers DDPM pipeline (the small UNet of examples/diffusers_pipeline.py, seeded
             random weights), N denoising steps, noise from a seeded CPU generator
    bert     a BERT-base forward (BertConfig() shape: 12 layers, hidden 768; random weights)
    train    one training step of BERT-base with a classification head (forward, cross-entropy,
             backward, SGD with momentum; dropout 0 so both sides compute the same thing)
    compile  torch.compile of a transformer MLP block (Linear, GELU, Linear, LayerNorm)
    attention scaled_dot_product_attention alone, causal, float16 (an LLM's prefill shape), where
             PyTorch picks a fused kernel (flash attention on current GPUs)

Every row also names the attention ops the flagos side ran (`attention_ops`): a fused kernel
(`_scaled_dot_product_flash_attention`, `..._efficient_attention`, `..._cudnn_attention`),
`scaled_dot_product_attention` itself where it reached the chip whole (device mode without a
backward: the payload device's own attention, its own choice), or none where attention ran as
the math decomposition (matmuls and a softmax).

Each check first runs both sides once from the same weights and inputs and compares the results
(tolerances in TOLERANCES, float32 with TF32 off), then times them interleaved (native, flagos,
native, ...) and reports medians and the flagos/native ratio; compile also reports each side's
first-call (compilation) time. In device mode the train check's native side runs in a process of
its own, before the flagos one (not interleaved): once PrivateUse1 is registered, PyTorch's
autograd cannot run a backward over plain cuda tensors in that process (pytorch/pytorch#161129;
flagos says so with AcceleratorBackwardError). "routed ops" counts the aten calls flagos routed in the flagos
side's first run (a compiled graph's calls are counted as graphs, not ops). In native mode the native side runs with flagos deactivated and
the flagos side with it activated (activation is outside the timed region). The whole run takes
well under 5 minutes on a current GPU (`--quick`: fewer iterations and steps).

Exit status: 0 every check passed, 1 a check failed or could not run, 2 no NVIDIA GPU (one
line says so; nothing else runs) or a usage error.

`--dry-run` needs no GPU: the models are built on the CPU and each check runs its whole
plumbing (children, activation, comparison, timing, table, JSON) for one iteration with the
cpu chip against plain PyTorch on the CPU, at small sizes (a 2-layer, 64-wide BERT). It checks the script, not the GPU:
its ratios say nothing about CUDA.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

MODES = ("device", "native")
CHECKS = ("ddpm", "bert", "train", "compile", "attention")
# (rtol, atol) per check, float32 with TF32 off on both sides (attention: float16, the same
# fused kernel on both sides)
TOLERANCES = {"ddpm": (1e-3, 1e-3), "bert": (1e-4, 1e-4), "train": (1e-4, 1e-5), "compile": (1e-4, 1e-4),
              "attention": (1e-3, 1e-3)}
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
# (mode, check) whose native side runs in a reference process without flagos (see the docstring)
NATIVE_ELSEWHERE = {("device", "train")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- sizes -----------------------------------------------------------------------------

def sizes(quick: bool, dry_run: bool) -> dict:
    if dry_run:  # the plumbing only, on a 2-core CPU
        return {"iters": 1, "ddpm_steps": 2, "bert_batch": 1, "bert_seq": 16, "train_batch": 1,
                "train_seq": 16, "mlp_tokens": 8, "mlp_hidden": 64, "bert": "tiny",
                "attention": (1, 2, 16, 8), "attention_dtype": "float32"}
    if quick:
        return {"iters": 5, "ddpm_steps": 10, "bert_batch": 8, "bert_seq": 128, "train_batch": 8,
                "train_seq": 128, "mlp_tokens": 512, "mlp_hidden": 1024, "bert": "base",
                "attention": (2, 16, 1024, 64), "attention_dtype": "float16"}
    return {"iters": 15, "ddpm_steps": 25, "bert_batch": 16, "bert_seq": 128, "train_batch": 16,
            "train_seq": 128, "mlp_tokens": 2048, "mlp_hidden": 1024, "bert": "base",
            "attention": (4, 16, 2048, 64), "attention_dtype": "float16"}


# ---- the child: one mode, every check ----------------------------------------------------

class Sides:
    """Plain PyTorch and flagos in one process: where each side's tensors go, and the context
    the flagos side runs in."""

    def __init__(self, mode: str, chip: str, native_device):
        import torch
        self.torch, self.mode, self.chip, self.native = torch, mode, chip, native_device
        if mode == "reference":  # plain PyTorch only: flagos is not even imported
            self.flagos, self.info, self.device = None, {}, native_device
            return
        import flagos
        self.flagos = flagos
        if mode == "device":
            self.info = flagos.activate(chip, mode="device")
            self.device = flagos.device()
        else:
            self.info = flagos.activate(chip, mode="native")
            self.device = flagos.device()
            flagos.deactivate()

    @contextmanager
    def on(self):
        """The flagos side: nothing to do in device mode (its tensors are flagos tensors);
        activated around the call in native mode."""
        if self.mode == "native" and self.flagos is not None:
            self.flagos.activate(self.chip, mode="native")
            try:
                yield
            finally:
                self.flagos.deactivate()
        else:
            yield

    def sync(self) -> None:
        if self.native.type == "cuda":
            self.torch.cuda.synchronize()


def _to_numpy(value):
    import numpy as np
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").double().numpy()
    if isinstance(value, (list, tuple)):
        return np.concatenate([_to_numpy(v).ravel() for v in value])
    return np.asarray(value, dtype=np.float64)


def _compare(name: str, native, routed) -> dict:
    import numpy as np
    a, b = _to_numpy(native), _to_numpy(routed)
    rtol, atol = TOLERANCES[name]
    if a.shape != b.shape:
        return {"ok": False, "max_abs_diff": None, "detail": f"shapes differ: {a.shape} vs {b.shape}"}
    diff = float(np.max(np.abs(a - b))) if a.size else 0.0
    finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
    ok = finite and bool(np.allclose(b, a, rtol=rtol, atol=atol))
    return {"ok": ok, "max_abs_diff": diff,
            "detail": "" if ok else ("non-finite values" if not finite else f"beyond rtol {rtol}, atol {atol}")}


def check_ddpm(sides: Sides, s: dict):
    import torch
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"))
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    pipes = {"native": copy.deepcopy(pipe).to(sides.native), "flagos": pipe.to(sides.device)}

    def make(side):
        def run():
            with torch.no_grad():
                generator = torch.Generator("cpu").manual_seed(0)  # the same noise on both sides
                return pipes[side](batch_size=1, generator=generator, num_inference_steps=s["ddpm_steps"],
                                   output_type="np").images
        return run
    return make("native"), make("flagos"), f"{s['ddpm_steps']} steps, 32x32, batch 1"


def _bert_config(s: dict, **kw):
    """BERT-base's shape (BertConfig()'s defaults: 12 layers, hidden 768, 12 heads, FFN 3072,
    vocabulary 30522); a 2-layer, 64-wide one for --dry-run."""
    from transformers import BertConfig
    if s["bert"] == "tiny":
        kw.update(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=128)
    return BertConfig(**kw)


def check_bert(sides: Sides, s: dict):
    import torch
    from transformers import BertModel
    torch.manual_seed(0)
    config = _bert_config(s)
    model = BertModel(config).eval()
    models = {"native": copy.deepcopy(model).to(sides.native), "flagos": model.to(sides.device)}
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (s["bert_batch"], s["bert_seq"]), generator=gen)
    mask = torch.ones_like(ids)
    inputs = {"native": (ids.to(sides.native), mask.to(sides.native)),
              "flagos": (ids.to(sides.device), mask.to(sides.device))}

    def make(side):
        def run():
            with torch.no_grad():
                i, m = inputs[side]
                return models[side](input_ids=i, attention_mask=m).last_hidden_state
        return run
    return make("native"), make("flagos"), f"BERT-{s['bert']}, batch {s['bert_batch']} x {s['bert_seq']} tokens"


def check_train(sides: Sides, s: dict):
    """The compared result is the loss of the first step and every parameter after it; the
    timed calls are further steps (each side keeps training its own copy)."""
    import torch
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    config = _bert_config(s, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2)
    model = BertForSequenceClassification(config).train()
    models = {"native": copy.deepcopy(model).to(sides.native), "flagos": model.to(sides.device)}
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (s["train_batch"], s["train_seq"]), generator=gen)
    labels = torch.randint(0, 2, (s["train_batch"],), generator=gen)
    dev = {"native": sides.native, "flagos": sides.device}
    inputs = {k: (ids.to(d), labels.to(d)) for k, d in dev.items()}
    first = {}

    def make(side):
        def run():
            i, y = inputs[side]
            optims[side].zero_grad(set_to_none=True)
            loss = models[side](input_ids=i, labels=y).loss
            loss.backward()
            optims[side].step()
            if side not in first:  # the compared result: the first step's loss and weights
                first[side] = True
                return [loss.detach().reshape(1)] + [p.detach() for p in models[side].parameters()]
            return loss
        return run
    return make("native"), make("flagos"), f"BERT-{s['bert']}, batch {s['train_batch']} x {s['train_seq']}, SGD"


def check_compile(sides: Sides, s: dict):
    import torch
    h, n = s["mlp_hidden"], s["mlp_tokens"]
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h),
                                torch.nn.LayerNorm(h)).eval()
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(3))
    # Each side's module gets a forward of its own (a code object of its own): Dynamo caches
    # compiled code per code object and does not guard on flagos's native-mode dispatch mode,
    # so with one forward the flagos side would reuse the native side's compiled code.
    compiled = {"native": torch.compile(_own_forward(copy.deepcopy(block)).to(sides.native)),
                "flagos": torch.compile(_own_forward(block).to(sides.device))}
    inputs = {"native": x.to(sides.native), "flagos": x.to(sides.device)}

    def make(side):
        def run():
            with torch.no_grad():
                return compiled[side](inputs[side])
        return run
    return make("native"), make("flagos"), f"{n} x {h}, hidden {4 * h}"


def check_attention(sides: Sides, s: dict):
    import torch
    shape, dtype = s["attention"], getattr(torch, s["attention_dtype"])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(3))
    inputs = {"native": tuple(t.to(sides.native) for t in (q, k, v)),
              "flagos": tuple(t.to(sides.device) for t in (q, k, v))}

    def make(side):
        def run():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(*inputs[side], is_causal=True)
        return run
    return make("native"), make("flagos"), f"{' x '.join(map(str, shape))}, {s['attention_dtype']}, causal"


def _own_forward(module):
    """`module` as an instance of a new subclass whose forward is a fresh code object."""
    namespace = {}
    exec("def forward(self, x):\n    for layer in self:\n        x = layer(x)\n    return x", namespace)
    module.__class__ = type(f"Own{type(module).__name__}", (type(module),), {"forward": namespace["forward"]})
    return module


BUILDERS = {"ddpm": check_ddpm, "bert": check_bert, "train": check_train, "compile": check_compile,
            "attention": check_attention}


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _timed(sides: Sides, fn, flagos_side: bool) -> tuple[float, object]:
    with sides.on() if flagos_side else _nothing():
        sides.sync()
        start = time.perf_counter()
        out = fn()
        sides.sync()
        return (time.perf_counter() - start) * 1e3, out


@contextmanager
def _nothing():
    yield


def run_check(sides: Sides, name: str, s: dict, reference: str | None) -> dict:
    """One check in this process. `reference`: the folder where the reference process leaves
    (and this process finds) the native side of the NATIVE_ELSEWHERE checks."""
    import torch
    row = {"mode": sides.mode, "check": name, "rtol": TOLERANCES[name][0], "atol": TOLERANCES[name][1]}
    saved = os.path.join(reference or "", f"{name}.pt")
    native_here = sides.mode == "reference" or (sides.mode, name) not in NATIVE_ELSEWHERE
    try:
        native_fn, flagos_fn, what = BUILDERS[name](sides, s)
        row["what"] = what
        if sides.mode == "reference":  # the native side alone, kept for the flagos process
            first_native, out_native = _timed(sides, native_fn, False)
            out_native = _to_cpu(out_native)  # a copy: train's further steps update the weights
            native_ms = [_timed(sides, native_fn, False)[0] for _ in range(s["iters"])]
            torch.save({"out": out_native, "first_ms": first_native,
                        "median_ms": statistics.median(native_ms)}, saved)
            return row
        graphs = _graphs_compiled()
        if native_here:
            first_native, out_native = _timed(sides, native_fn, False)
        else:
            kept = torch.load(saved)
            first_native, out_native = kept["first_ms"], kept["out"]
            row["native_ms"] = kept["median_ms"]
            row["native_elsewhere"] = True
        native_graphs = _graphs_compiled() - graphs
        sides.flagos.reset_report()
        with sides.on():
            first_flagos, out_flagos = _timed(sides, flagos_fn, False)
            report = sides.flagos.fallback_report()
        if name == "compile":  # whether each side's call compiled anything (or ran eagerly)
            row["graphs_compiled"] = {"native": native_graphs, "flagos": _graphs_compiled() - graphs - native_graphs}
        row["flagos_op_calls"] = report.calls()  # the report is a snapshot
        row["fallback_ops"] = list(report.fallback_ops)
        row["compiled_calls"] = report.compiled_calls
        row["attention_ops"] = sorted(r["op"] for r in report.rows if "attention" in r["op"])
        row.update(_compare(name, out_native, out_flagos))
        row["first_call_ms"] = {"native": first_native, "flagos": first_flagos}
        native_ms, flagos_ms = [], []
        for _ in range(s["iters"]):  # interleaved
            if native_here:
                native_ms.append(_timed(sides, native_fn, False)[0])
            flagos_ms.append(_timed(sides, flagos_fn, True)[0])
        if native_here:
            row["native_ms"] = statistics.median(native_ms)
        row["flagos_ms"] = statistics.median(flagos_ms)
        row["ratio"] = row["flagos_ms"] / row["native_ms"] if row["native_ms"] > 0 else None
    except Exception as e:  # one check's failure is reported, the others still run
        import traceback
        traceback.print_exc(file=sys.stderr)
        row.update(ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return row


def _to_cpu(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return value


def child_main(mode: str, chip: str, dry_run: bool, quick: bool, checks: list[str], out: str,
               reference: str | None) -> int:
    os.environ.setdefault("FLAGOS_FALLBACK", "allow")  # fallbacks are counted in the rows
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    native = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    s = sizes(quick, dry_run)
    try:
        sides = Sides(mode, chip, native)
    except Exception as e:
        rows = [{"mode": mode, "check": c, "ok": False, "detail": f"activation failed: {type(e).__name__}: {e}"}
                for c in checks]
        info = {}
    else:
        rows = [run_check(sides, c, s, reference) for c in checks]
        info = {k: sides.info.get(k) for k in ("chip", "vendor", "mode", "device", "devices", "caches")}
    with open(out, "w") as f:
        json.dump({"rows": rows, "info": info}, f, default=str)
    return 0


# ---- the parent: no flagos here -----------------------------------------------------------

def _run_child(mode: str, args, checks: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        elsewhere = [c for c in checks if (mode, c) in NATIVE_ELSEWHERE]
        if elsewhere:
            _child_process("reference", args, elsewhere, tmp)
        return _child_process(mode, args, checks, tmp)


def _child_process(mode: str, args, checks: list[str], tmp: str) -> dict:
    out = os.path.join(tmp, f"{mode}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--child-out", out,
           "--reference", tmp, "--checks", ",".join(checks)] + (["--quick"] if args.quick else []) + \
          (["--dry-run"] if args.dry_run else [])
    env = dict(os.environ)
    env.pop("FLAGOS_DEVICE", None)  # the child activates itself, its own way
    env.pop("FLAGOS_DEVICE_BACKEND", None)
    env.pop("FLAGOS_MODE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL)
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return {"rows": [{"mode": mode, "check": c, "ok": False,
                      "detail": f"the {mode}-mode process exited with code {proc.returncode} "
                                f"before answering (its messages are above)"} for c in checks],
            "info": {}}


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[dict]) -> str:
    headers = ["mode", "check", "native ms", "flagos ms", "flagos/native", "max |diff|", "routed ops",
               "result", "what"]
    body = []
    for r in rows:
        result = "ok" if r.get("ok") else f"FAIL {r.get('detail', '')}".strip()
        if r.get("fallback_ops"):
            result += f" ({len(r['fallback_ops'])} ops fell back)"
        if r.get("native_elsewhere"):
            result += " (native side: a process of its own)"
        if r.get("attention_ops"):
            result += " [" + ", ".join(op.removeprefix("aten::").removeprefix("_scaled_dot_product_")
                                         for op in r["attention_ops"]) + "]"
        body.append([r["mode"], r["check"], _fmt(r.get("native_ms")), _fmt(r.get("flagos_ms")),
                     _fmt(r.get("ratio")), _fmt(r.get("max_abs_diff"), ".2e"),
                     _fmt(r.get("flagos_op_calls"), "d"), result, r.get("what", "")])
    cells = [headers] + body
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _gpu_line(torch) -> str:
    if not torch.cuda.is_available():
        return "none"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    major, minor = torch.cuda.get_device_capability(0)
    return f"{', '.join(names)} (sm{major}{minor}), CUDA {torch.version.cuda}"


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none)'}; use any of: {', '.join(allowed)}")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer iterations and denoising steps")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--modes", type=lambda t: _list(t, MODES, "mode"), default=list(MODES),
                   help="flagos modes to check (default: device,native)")
    p.add_argument("--checks", type=lambda t: _list(t, CHECKS, "check"), default=list(CHECKS),
                   help="checks to run (default: ddpm,bert,train,compile)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the cpu chip against plain PyTorch on the CPU, small sizes, one iteration")
    p.add_argument("--child", choices=MODES + ("reference",), help=argparse.SUPPRESS)
    p.add_argument("--reference", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    chip = "cpu" if args.dry_run else "cuda"
    if args.child:
        return child_main(args.child, chip, args.dry_run, args.quick, args.checks, args.child_out,
                          args.reference)
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print(f"no NVIDIA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}); run this on a machine with an NVIDIA GPU and its driver, "
              f"or pass --dry-run to check the script on the CPU", file=sys.stderr)
        return EXIT_NO_GPU
    start = time.perf_counter()
    rows, infos = [], {}
    for mode in args.modes:
        answer = _run_child(mode, args, args.checks)
        rows += answer["rows"]
        infos[mode] = answer["info"]
    elapsed = time.perf_counter() - start
    s = sizes(args.quick, args.dry_run)
    print(f"gpu_check{' --dry-run (cpu chip vs plain PyTorch on the CPU: checks the script, not a GPU)' if args.dry_run else ''}")
    print(f"machine: {platform.node()}, {platform.machine()}, torch {torch.__version__}, GPU: {_gpu_line(torch)}")
    print(f"median of {s['iters']} interleaved runs per side; float32, TF32 off; {elapsed:.0f} s in all")
    print(format_table(rows))
    for r in rows:
        if r["check"] == "compile" and r.get("first_call_ms"):
            first = r["first_call_ms"]
            print(f"compile, {r['mode']} mode: first call (compilation included) native "
                  f"{first['native'] / 1e3:.1f} s, flagos {first['flagos'] / 1e3:.1f} s; "
                  f"graphs compiled: native {r.get('graphs_compiled', {}).get('native')}, flagos "
                  f"{r.get('graphs_compiled', {}).get('flagos')}; compiled flagos graph calls "
                  f"{r.get('compiled_calls')}")
    ok = all(r.get("ok") for r in rows)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dry_run": args.dry_run, "quick": args.quick, "torch": torch.__version__,
                       "gpu": _gpu_line(torch), "seconds": elapsed, "sizes": s,
                       "tolerances": TOLERANCES, "flagos": infos, "results": rows}, f, indent=2, default=str)
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
