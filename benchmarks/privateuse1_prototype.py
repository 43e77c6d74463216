"""Prototype of mechanism B for the cpu chip: real PrivateUse1 tensors whose storage aliases
the CPU payload's memory, every op reached through a boxed Python fallback on PrivateUse1.

    python benchmarks/privateuse1_prototype.py bench      # per-op cost: native / trivial A / B (same process)
    python benchmarks/privateuse1_prototype.py fidelity   # the fidelity checks of docs/design.md §10 on B
    python benchmarks/privateuse1_prototype.py abort      # exception inside backward on B (run it in a subprocess)

Standalone: never import flagos in the same process (PrivateUse1 can be renamed once).

How a B tensor is built (no libtorch linkage needed):
- payload: a CPU UntypedStorage (owner of the memory);
- torch._C._construct_storage_from_data_pointer(ptr, proto:0, nbytes) makes a non-owning
  PrivateUse1 storage over the same bytes; the payload is kept alive as an attribute of that
  storage's Python object (PyTorch preserves a storage's PyObject while the StorageImpl lives);
- torch._C._acc.create_empty_tensor + the CPU `set_` kernel (redispatched) puts size, stride and
  offset on a TensorImpl with the PrivateUse1 key.
Unwrap for a kernel: a CPU tensor `set_` on the payload storage with the same geometry (and the
conj/neg bits re-applied). Views are PyTorch's own CPU view kernels redispatched, so they share
the StorageImpl and version counter exactly like CPU tensors.
"""
from __future__ import annotations

import sys

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "proto"
DEBUG = bool(globals().get("DEBUG"))  # set by a caller that execs this file
_setup_privateuseone_for_python_backend(NAME)
DEV = torch.device(NAME, 0)
CPU = torch.device("cpu")
CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
SET = torch.ops.aten.set_.source_Storage_storage_offset
_new_storage = torch._C._construct_storage_from_data_pointer
_create = torch._C._acc.create_empty_tensor


# ---- wrap / unwrap ------------------------------------------------------------------------
def p1_storage(cs: torch.UntypedStorage) -> torch.UntypedStorage:
    """A PrivateUse1 storage aliasing the CPU storage `cs`, which it keeps alive."""
    ps = _new_storage(cs.data_ptr(), DEV, cs.nbytes())
    ps._payload = cs
    return ps


def make(ps, dtype, size, stride, offset):
    t = _create([0], dtype)
    SET.redispatch(CPU_KS, t, ps, offset, size, stride)  # below ADInplaceOrView: no version bump
    return t


def wrap(c: torch.Tensor, seen: list) -> torch.Tensor:
    if c._is_zerotensor():  # storage-less on CPU too: materialize (values right, no fast path)
        c = torch.zeros(c.shape, dtype=c.dtype)
    cs = c.untyped_storage()
    ptr = cs.data_ptr()
    ps = None
    if ptr:  # an output aliasing an input shares that input's PrivateUse1 storage
        for t in seen:
            s = t.untyped_storage()
            if s.data_ptr() == ptr:
                ps = s
                break
    if ps is None:
        ps = p1_storage(cs)
    t = make(ps, c.dtype, c.size(), c.stride(), c.storage_offset())
    if c.is_conj():
        torch._C._set_conj(t, True)
    if c.is_neg():
        torch._C._set_neg(t, True)
    t._cpu = c  # the CPU alias, reused while the geometry matches
    return t


def unwrap(t: torch.Tensor, seen: list) -> torch.Tensor:
    seen.append(t)
    c = t.__dict__.get("_cpu")
    if (c is not None and c.data_ptr() == t.data_ptr() and c.size() == t.size()
            and c.stride() == t.stride() and c.is_conj() == t.is_conj() and c.is_neg() == t.is_neg()):
        return c
    c = torch.empty(0, dtype=t.dtype)
    SET.redispatch(CPU_KS, c, t.untyped_storage()._payload, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        torch._C._set_conj(c, True)
    if t.is_neg():
        torch._C._set_neg(c, True)
    t._cpu = c
    return c


def _is_p1(x):
    return type(x) is torch.Tensor and x.device.type == NAME or (
        isinstance(x, torch.Tensor) and x.device.type == NAME)


def _un(x, seen):
    if isinstance(x, torch.Tensor):
        return unwrap(x, seen) if x.device.type == NAME else x
    if isinstance(x, (list, tuple)):
        return type(x)(_un(y, seen) for y in x)
    if isinstance(x, torch.device) and x.type == NAME:
        return CPU
    return x


def _wr(x, seen):
    if isinstance(x, torch.Tensor):
        return wrap(x, seen) if x.device.type == "cpu" else x
    if isinstance(x, (list, tuple)):
        return type(x)(_wr(y, seen) for y in x)
    return x


# ---- the router: one boxed fallback for every op on PrivateUse1 ----------------------------
_INFO: dict = {}  # op -> (indices of written args, per return: index of the written arg or None)


def _info(op):
    info = _INFO.get(op)
    if info is None:
        schema = op._schema
        args = list(schema.arguments)
        written = tuple(i for i, a in enumerate(args)
                        if a.alias_info is not None and a.alias_info.is_write)
        rets = []
        for r in schema.returns:
            idx = None
            if r.alias_info is not None and r.alias_info.is_write:
                idx = next(i for i, a in enumerate(args) if a.alias_info is not None
                           and a.alias_info.before_set == r.alias_info.before_set)
            rets.append(idx)
        info = _INFO[op] = (written, tuple(rets), tuple(a.name for a in args))
    return info


def route(op, *args, **kwargs):
    if DEBUG: print("route", op, flush=True)
    written, rets, names = _info(op)
    seen: list = []
    cargs = [_un(a, seen) for a in args]
    ckw = {k: _un(v, seen) for k, v in kwargs.items()} if kwargs else kwargs
    out = op(*cargs, **ckw)

    def arg(i, lst, kw):
        return lst[i] if i < len(lst) else kw.get(names[i])
    # mutable arguments: if the CPU kernel resized/reallocated, rebind the PrivateUse1 tensor
    for i in written:
        orig = arg(i, args, kwargs)
        if isinstance(orig, torch.Tensor) and orig.device.type == NAME:
            _rebind(orig, arg(i, cargs, ckw))
    if len(rets) == 1:
        return arg(rets[0], args, kwargs) if rets[0] is not None else _wr(out, seen)
    return tuple(arg(r, args, kwargs) if r is not None else _wr(o, seen) for r, o in zip(rets, out))


def _rebind(orig, new):
    ps = orig.untyped_storage()
    cs = new.untyped_storage()
    if ps._payload.data_ptr() != cs.data_ptr() or ps.data_ptr() != cs.data_ptr():
        # the CPU kernel reallocated: give the tensor a new aliasing storage
        # (views of the old storage keep the old bytes: a gap a real build must close)
        ps = p1_storage(cs)
    if (orig.size() != new.size() or orig.stride() != new.stride()
            or orig.storage_offset() != new.storage_offset() or ps is not orig.untyped_storage()):
        SET.redispatch(CPU_KS, orig, ps, new.storage_offset(), new.size(), new.stride())


_lib_fb = torch.library.Library("_", "IMPL")
_lib_fb.fallback(route, dispatch_key="PrivateUse1")
_lib = torch.library.Library("aten", "IMPL")


def _redispatch_cpu(opname):
    op = eval("torch.ops.aten." + opname)

    def kernel(*args, **kwargs):
        return op.redispatch(CPU_KS, *args, **kwargs)
    _lib.impl(opname.replace(".default", ""), kernel, "PrivateUse1")


# metadata-only kernels: PyTorch's own CPU implementations work on any TensorImpl
for _n in ("set_.source_Storage_storage_offset", "set_.source_Storage", "as_strided.default", "view.default",
           "_reshape_alias.default", "unfold.default", "view_as_real.default",
           "view_as_complex.default"):
    _redispatch_cpu(_n)


def _via_route(opname):
    op = eval("torch.ops.aten." + opname)

    def kernel(*args, **kwargs):
        return route(op, *args, **kwargs)
    _lib.impl(opname.replace(".default", ""), kernel, "PrivateUse1")


# CompositeExplicitAutograd ops whose decomposition picks a backend by device
# (convolution -> convolution_overrideable otherwise): send them whole to the router
for _n in ("convolution.default", "convolution_backward.default"):
    _via_route(_n)


def _copy_from(src, dst, non_blocking=False):
    seen: list = []
    cdst = _un(dst, seen)
    cdst.copy_(_un(src, seen))
    return dst


def _copy_from_and_resize(src, dst):
    if dst.size() != src.size():
        dst.resize_(src.size())
    return _copy_from(src, dst)


# Without a PrivateUse1 kernel, a structured op (add.Tensor) runs PyTorch's
# CompositeExplicitAutogradNonFunctional wrapper: empty + add.out, two trips through the router.
# A real B registers the router as the PrivateUse1 kernel of every op it routes; here a few.
for _n in ("add.Tensor", "add_.Tensor", "mul.Tensor", "sub.Tensor", "relu.default", "sum.default",
           "native_group_norm.default", "native_group_norm_backward.default",
           "_scaled_dot_product_flash_attention_for_cpu.default",
           "_scaled_dot_product_flash_attention_for_cpu_backward.default",
           "threshold_backward.default", "mm.default", "addmm.default"):
    _via_route(_n)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """PyTorch picks the attention backend by device type and gives PrivateUse1 the math
    decomposition; like flagos today, choose the fused CPU kernel at the autograd key."""
    if attn_mask is None and dropout_p == 0.0 and not enable_gqa:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


_lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")


# copies between devices: no CPU kernel of these names exists, the CPU side is `copy_`
_lib.impl("_copy_from", _copy_from, "PrivateUse1")
_lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
# copy_ sends non-CPU/CUDA copies to _copy_from, which the Conjugate/Negative fallbacks would
# materialize with resolve_conj -> copy_ -> _copy_from ... (endless recursion, segfault):
# _copy_from carries the bits itself (the CPU copy_ resolves them)
for _k in ("Conjugate", "Negative"):
    for _n in ("_copy_from", "_copy_from_and_resize"):
        _lib.impl(_n, torch.library.fallthrough_kernel, _k)


# ---- a trivial A in the same process, for the floors -----------------------------------------
class Wrapper(torch.Tensor):
    """A bare wrapper subclass (device meta so it cannot collide with PrivateUse1 here)."""

    @staticmethod
    def __new__(cls, payload):
        r = torch.Tensor._make_wrapper_subclass(cls, payload.size(), strides=payload.stride(),
                                                dtype=payload.dtype, device="meta")
        r._payload = payload
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        un = [a._payload if isinstance(a, Wrapper) else a for a in args]
        out = func(*un, **kwargs)
        if isinstance(out, torch.Tensor):
            if func._schema.returns[0].alias_info is not None and func._schema.returns[0].alias_info.is_write:
                return args[0]
            return Wrapper(out)
        return out


_CACHED = {}


class TrivialA(torch.Tensor):
    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="meta")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _CACHED["a"]


def bench(number=2000, repeat=3, rounds=5):
    import os
    import platform
    import statistics
    import time

    import torch.nn.functional as F
    torch.set_num_threads(1)

    def med(fn, n):
        for _ in range(max(n // 10, 3)):
            fn()
        runs = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(runs)

    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.randn(1, 256, 8, 8)
    w = torch.randn(256, 256, 3, 3)
    q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    gx = torch.randn(1, 256, 8, 8)
    cases = {
        "add 8x8": (lambda a, b: a + b, (a, b), number),
        "add_ 8x8": (lambda a, b: a.add_(b), (a.clone(), b), number),
        "conv2d 1x256x8x8 3x3": (lambda x, w: F.conv2d(x, w, padding=1), (x, w), 30),
        "sdpa 1x8x128x64": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), 100),
        "group_norm 1x256x8x8 g32": (lambda x: F.group_norm(x, 32), (gx,), 1000),
    }
    # B: same data on the proto device; A-py: a Python wrapper subclass holding a CPU payload
    # floors: the entry alone (kernel returns a cached tensor), atan2 so no other kernel interferes
    ta, tb = TrivialA((8, 8)), TrivialA((8, 8))
    _CACHED["a"] = a
    cached = a.to(DEV)
    floor_lib = torch.library.Library("aten", "IMPL")
    floor_lib.impl("atan2", lambda x, y: cached, "PrivateUse1")
    fa, fb = a.to(DEV), b.to(DEV)
    cases["floor: torch.atan2 8x8"] = (torch.atan2, (a, b), number)
    res = {}
    for name, (f, args, n) in cases.items():
        bargs = tuple(t.to(DEV) for t in args)
        aargs = tuple(Wrapper(t.clone()) for t in args)
        if name.startswith("floor"):
            aargs, bargs = (ta, tb), (fa, fb)
        elif "add_" not in name:
            assert torch.allclose(f(*args), f(*bargs).cpu(), atol=1e-4), name
        rows = {"native": [], "A-py": [], "B": []}
        for _ in range(rounds):  # interleave
            rows["native"].append(med(lambda f=f, args=args: f(*args), n))
            rows["A-py"].append(med(lambda f=f, aargs=aargs: f(*aargs), n))
            rows["B"].append(med(lambda f=f, bargs=bargs: f(*bargs), n))
        res[name] = {k: statistics.median(v) for k, v in rows.items()}
    cpu = "?"
    with open("/proc/cpuinfo") as fh:
        cpu = next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
    print(f"machine: {cpu}, {os.cpu_count()} cores (shared), {torch.get_num_threads()} thread, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"medians of {rounds} interleaved rounds, each the median of {repeat} runs; µs per call")
    print(f"{'op':<28}{'native':>9}{'A-py':>9}{'B':>9}{'B-nat':>9}")
    for name, r in res.items():
        print(f"{name:<28}{r['native']:>9.2f}{r['A-py']:>9.2f}{r['B']:>9.2f}{r['B'] - r['native']:>9.2f}")
    print(f"load average at end: {os.getloadavg()}")


# ---- fidelity checks (each compared with the same code on plain CPU) -------------------------
def _check(name, fn):
    import traceback
    try:
        res = fn()
        print(f"[{'ok' if res is True else 'FAIL'}] {name}" + ("" if res is True else f": {res}"))
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"[ERR ] {name}: {msg}")
        if DEBUG:
            traceback.print_exc()


def fidelity():
    import copy
    import os
    import tempfile

    import torch.nn as nn
    d = DEV

    def conj_mul():
        z = torch.tensor([1 + 2j, 3 - 4j])
        got = (z.to(d).conj() * z.to(d)).cpu()
        return torch.equal(got, z.conj() * z) or f"got {got}"

    def conj_imag():
        z = torch.tensor([1 + 2j, 3 - 4j])
        got = z.to(d).conj().imag.cpu()
        return torch.equal(got, z.conj().imag) or f"got {got}"

    def resolve():
        z = torch.tensor([1 + 2j, 3 - 4j])
        zc = z.to(d).conj()
        ok = zc.is_conj() and not zc.resolve_conj().is_conj()
        got = zc.resolve_conj().cpu(), zc.cpu(), (zc.mH @ zc.reshape(2, 1)).cpu() if False else None
        return (ok and torch.equal(got[0], z.conj().resolve_conj()) and torch.equal(got[1], z.conj())) or f"got {got}"

    def neg_bit():
        z = torch.tensor([1 + 2j, 3 - 4j])
        n = torch._neg_view(z.to(d))
        return (n.is_neg() and torch.equal((n * 2).cpu(), torch._neg_view(z) * 2)
                and torch.equal(n.cpu(), -z)) or "neg view wrong"

    def mH_mm():
        x = torch.tensor([[1 + 2j, 3 - 4j], [0.5j, 2]])
        got = (x.to(d).mH @ x.to(d)).cpu()
        return torch.allclose(got, x.mH @ x) or f"got {got}"

    def set_data():
        w = torch.zeros(2, 3, device=d)
        w.data = torch.ones(4, 3, device=d)
        return (w.shape == (4, 3) and w.sum().item() == 12.0) or f"shape {w.shape} sum {w.sum().item()}"

    def set_data_cpu():
        w = torch.zeros(2, 3, device=d)
        w.data = torch.ones(4, 3)
        return w.sum().item() == 12.0 or "no error, wrong"

    def param_kept():
        m = nn.Linear(3, 2)
        p = m.weight
        m.to(d)
        return (type(m.weight) is nn.Parameter and m.weight.device == d
                and isinstance(m.weight, nn.Parameter)) or f"type {type(m.weight)}, same object {m.weight is p}"

    def param_identity():
        m = nn.Linear(3, 2)
        p = m.weight
        m.to(d)
        return (m.weight is p) or "new Parameter object (CPU->PrivateUse1 is not a shallow-copy-compatible pair)"

    def safetensors_save():
        from safetensors.torch import load_file, save_file
        m = nn.Linear(4, 3).to(d)
        sd = {k: v.detach() for k, v in m.state_dict().items()}
        with tempfile.TemporaryDirectory() as tmp:
            f = os.path.join(tmp, "m.safetensors")
            save_file(sd, f)
            back = load_file(f)
        return all(torch.equal(back[k], sd[k].cpu()) for k in sd) or "mismatch"

    def safetensors_shared():
        from safetensors.torch import save_file
        a = torch.randn(4, device=d)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                save_file({"a": a, "b": a[:2]}, os.path.join(tmp, "x.safetensors"))
            except RuntimeError as e:
                return ("share memory" in str(e)) or str(e)[:100]
        return "shared storage not detected"

    def data_ptr():
        x = torch.arange(4.0, device=d)
        return (x.data_ptr() != 0 and x[1:].data_ptr() == x.data_ptr() + 4
                and x.untyped_storage().nbytes() == 16) or "bad data_ptr"

    def inference_view():
        x = torch.randn(3, 4, device=d)
        with torch.inference_mode():
            v = x[0]
            y = v * 2
        return (y.is_inference() and not x.is_inference()
                and torch.equal(y.cpu(), x.cpu()[0] * 2)) or "wrong"

    def inference_made_inside():
        with torch.inference_mode():
            x = torch.ones(3, device=d) * 3
        return (x.is_inference() and torch.equal(x.cpu(), torch.full((3,), 3.0))) or "wrong"

    def version_counter():
        x = torch.zeros(3, device=d)
        v = x[1:]
        v0 = x._version
        v.add_(1)
        return (x._version == v0 + 1 and v._version == x._version
                and x.cpu().tolist() == [0, 1, 1]) or f"versions {v0} {x._version} {v._version}"

    def inplace_view():
        x = torch.zeros(2, 3, device=d)
        x[0].add_(1)
        x[:, 1].mul_(5)
        c = torch.zeros(2, 3)
        c[0].add_(1)
        c[:, 1].mul_(5)
        return torch.equal(x.cpu(), c) or f"got {x.cpu()}"

    def strides():
        c = torch.randn(2, 3, 4, 5)
        x = c.to(d)
        checks = [
            (x.permute(0, 2, 3, 1).contiguous().stride(), c.permute(0, 2, 3, 1).contiguous().stride()),
            (x.to(memory_format=torch.channels_last).stride(), c.to(memory_format=torch.channels_last).stride()),
            (torch.empty_like(x.to(memory_format=torch.channels_last)).stride(),
             torch.empty_like(c.to(memory_format=torch.channels_last)).stride()),
            ((x.transpose(1, 2) + 1).stride(), (c.transpose(1, 2) + 1).stride()),
        ]
        return all(a == b for a, b in checks) or f"{checks}"

    def tolist():
        x = torch.tensor([[1, 2], [3, 4]], device=d)
        return x.tolist() == [[1, 2], [3, 4]] or f"got {x.tolist()}"

    def item_format():
        x = torch.tensor(3.14159, device=d)
        return f"{x:.3e}" == f"{torch.tensor(3.14159):.3e}" or f"got {x:.3e}"

    def numpy_msg():
        x = torch.ones(2, device=d)
        try:
            x.numpy()
        except TypeError as e:
            return ("cpu()" in str(e)) or str(e)
        return "no error"

    def deepcopy():
        x = torch.arange(4.0, device=d)
        y = copy.deepcopy(x)
        y.add_(1)
        return (y.device == d and torch.equal(x.cpu(), torch.arange(4.0))
                and torch.equal(y.cpu(), torch.arange(4.0) + 1)) or "wrong"

    def deepcopy_module():
        m = nn.Linear(3, 2).to(d)
        m2 = copy.deepcopy(m)
        return (type(m2.weight) is nn.Parameter and torch.equal(m2.weight.cpu(), m.weight.cpu())
                and m2.weight.data_ptr() != m.weight.data_ptr()) or "wrong"

    def backward():
        torch.manual_seed(0)
        xc = torch.randn(4, 3, requires_grad=True)
        wc = torch.randn(2, 3, requires_grad=True)
        x = xc.detach().to(d).requires_grad_()
        w = wc.detach().to(d).requires_grad_()
        torch.nn.functional.linear(x, w).relu().pow(2).sum().backward()
        torch.nn.functional.linear(xc, wc).relu().pow(2).sum().backward()
        return (torch.allclose(x.grad.cpu(), xc.grad) and torch.allclose(w.grad.cpu(), wc.grad)
                and x.grad.device == d) or "grad mismatch"

    def conv_backward():
        torch.manual_seed(0)
        xc = torch.randn(1, 4, 6, 6, requires_grad=True)
        wc = torch.randn(8, 4, 3, 3, requires_grad=True)
        x = xc.detach().to(d).requires_grad_()
        w = wc.detach().to(d).requires_grad_()
        torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
        torch.nn.functional.conv2d(xc, wc, padding=1).sum().backward()
        return (torch.allclose(x.grad.cpu(), xc.grad, atol=1e-5)
                and torch.allclose(w.grad.cpu(), wc.grad, atol=1e-5)) or "grad mismatch"

    def optimizer():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
        mc = copy.deepcopy(m)
        m.to(d)
        oc = torch.optim.AdamW(mc.parameters(), lr=0.1)
        o = torch.optim.AdamW(m.parameters(), lr=0.1)
        xin = torch.randn(5, 4)
        for _ in range(3):
            oc.zero_grad(); mc(xin).pow(2).sum().backward(); oc.step()
            o.zero_grad(); m(xin.to(d)).pow(2).sum().backward(); o.step()
        return all(torch.allclose(p.cpu(), q, atol=1e-5) for p, q in zip(m.parameters(), mc.parameters())) or "diverged"

    def out_resize():
        a = torch.randn(3, device=d)
        out = torch.empty(0, device=d)
        torch.add(a, 1, out=out)
        return (out.shape == (3,) and torch.equal(out.cpu(), a.cpu() + 1)) or f"got {out.shape}"

    def compile_inductor():
        torch._dynamo.reset()
        f = torch.compile(lambda x: (x.sin() + 1) * 2, backend="inductor")
        x = torch.randn(8)
        got = f(x.to(d))
        return torch.allclose(got.cpu(), (x.sin() + 1) * 2) or "mismatch"

    def compile_aot_eager():
        torch._dynamo.reset()
        f = torch.compile(lambda x: (x.sin() + 1) * 2, backend="aot_eager")
        x = torch.randn(8)
        got = f(x.to(d))
        return torch.allclose(got.cpu(), (x.sin() + 1) * 2) or "mismatch"

    def zerotensor():
        x = torch.randn(3, device=d, requires_grad=True)
        torch.sgn(x).sum().backward()
        return torch.equal(x.grad.cpu(), torch.zeros(3)) or f"got {x.grad}"

    def torch_save():
        import io
        x = torch.arange(4.0, device=d)
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        y = torch.load(buf, map_location="cpu")
        return torch.equal(y, torch.arange(4.0)) or "mismatch"

    only = os.environ.get("PROTO_ONLY")
    for name, fn in [
        ("conj: (z.conj()*z)", conj_mul), ("conj: x.conj().imag", conj_imag),
        ("conj: resolve_conj / .cpu() of conj view", resolve), ("neg bit: _neg_view", neg_bit),
        ("conj: x.mH @ x", mH_mm),
        ("w.data = other (same device)", set_data), ("w.data = cpu tensor", set_data_cpu),
        ("nn.Parameter after module.to(dev)", param_kept),
        ("parameter identity kept by module.to(dev)", param_identity),
        ("safetensors save_file/load_file", safetensors_save),
        ("safetensors detects shared storage", safetensors_shared),
        ("data_ptr/untyped_storage valid", data_ptr),
        ("inference_mode: view of outside tensor", inference_view),
        ("inference_mode: tensor made inside", inference_made_inside),
        ("version counter shared by views", version_counter),
        ("views + in-place (x[0].add_(1))", inplace_view), ("strides like CPU", strides),
        ("tensor.tolist()", tolist), ("f'{t:.3e}' on 0-dim", item_format),
        (".numpy() message says .cpu()", numpy_msg), ("copy.deepcopy(tensor)", deepcopy),
        ("copy.deepcopy(module)", deepcopy_module),
        ("autograd backward (linear/relu)", backward), ("autograd backward (conv2d)", conv_backward),
        ("AdamW 3 steps vs CPU", optimizer), ("out= with resize", out_resize),
        ("sgn backward (zero tensor)", zerotensor), ("torch.save/torch.load", torch_save),
        ("torch.compile backend=aot_eager", compile_aot_eager),
        ("torch.compile backend=inductor", compile_inductor),
    ]:
        if only is not None:
            if fn.__name__ == only:
                _check(name, fn)
        elif fn.__name__ in ("deepcopy", "deepcopy_module"):  # can kill the process: subprocess
            import subprocess
            r = subprocess.run([sys.executable, __file__, "fidelity"], env=dict(os.environ, PROTO_ONLY=fn.__name__),
                               capture_output=True, text=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("[")]
            print(line[0] if line else f"[CRASH] {name}: exit {r.returncode} "
                  f"({'SIGSEGV' if r.returncode == -11 else r.stderr.strip().splitlines()[-1:]})")
        else:
            _check(name, fn)


def abort():
    """An exception raised by a kernel while autograd runs backward."""
    from torch.autograd import Function

    class Boom(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom in backward")
    x = torch.ones(3, device=DEV, requires_grad=True)
    try:
        Boom.apply(x).sum().backward()
    except ValueError as e:
        print("python Function.backward raised to caller:", e, flush=True)
    # a kernel that fails inside the engine (the router raising, as FLAGOS_FALLBACK=error would)
    lib = torch.library.Library("aten", "IMPL")
    def fail(*a, **k):
        raise RuntimeError("kernel failed in backward")
    lib.impl("threshold_backward", fail, "PrivateUse1")
    y = torch.randn(3, device=DEV, requires_grad=True)
    try:
        y.relu().sum().backward()
    except RuntimeError as e:
        print("kernel error raised to caller:", str(e).splitlines()[0], flush=True)
    z = torch.randn(3, device=DEV, requires_grad=True)
    (z * 2).sum().backward()
    print("process still usable:", torch.equal(z.grad.cpu(), torch.full((3,), 2.0)), flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "bench"
    if what == "bench":
        bench()
    else:
        globals()[what]()
