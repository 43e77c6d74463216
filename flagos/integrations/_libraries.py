"""What Diffusers, accelerate and transformers decide about devices, answered for flagos.

No library is edited. While flagos owns the device (device mode):

- Diffusers decides its accelerator once (`TorchDeviceBackend._detect_device_type`, cached) when
  `diffusers.pipelines` is imported. An import before `flagos.activate()` cached "cpu", and
  `enable_model_cpu_offload()` then says no accelerator exists: activation clears that cache and
  adds the flagos device to the device-map names computed from it.
- accelerate picks its default device from a list of named backends (cuda, npu, xpu, ...) and
  reads accelerator memory through each one's module, so it would never find flagos:
  `PartialState().device` (and so `Accelerator().device`) becomes `flagos.device()`, and
  `get_max_memory()` lists the flagos devices by index, as accelerate lists GPUs, with their free
  memory from `torch.flagos.mem_get_info` (an index means the current accelerator to PyTorch:
  `torch.device(0)` is flagos:0).
- accelerate knows no distributed type for flagos: processes started by a launcher
  (`LOCAL_RANK` set) get the "flagos" process group (`flagos.dist_backend()`), accelerate's
  MULTI_GPU type and flagos:(local rank % device count) as their device, and
  `Accelerator.prepare` gives DDP that device's index.
- accelerate's `mixed_precision="fp16"` names the devices it runs on (cuda, npu, xpu, ...) and
  makes CUDA's GradScaler for all but a few: flagos joins the names, and gets its own scaler.
- transformers' `TrainingArguments.device` (what the `Trainer` moves batches to) asks accelerate
  only in distributed runs; alone it lists the named accelerators and ends at "cpu", while the
  `Trainer`'s accelerate places the model on flagos: "argument 'indices' is a tensor on cpu, but
  the op runs on flagos". Without `use_cpu` it is accelerate's device, as in distributed runs;
  and `bf16=True` is accepted where the chip runs bfloat16 natively.
  A `pipeline()` given a device index, or none (index 0), maps it to the first named accelerator
  it finds and else to "cpu", moving a model already on flagos back to the host: the index means
  flagos:N, as it means cuda:N on a GPU.
- safetensors checks device names in Rust against the ones it knows, so
  `safetensors.torch.load_file(path, device="flagos")` (Diffusers' group offloading to disk)
  loads to the host and moves the tensors to flagos.
- huggingface_hub finds tensors that share memory (tied weights, when `save_pretrained` splits a
  state dict into shards) through the inner tensors of a wrapper subclass's
  `__tensor_flatten__`; a C-ABI chip's tensor has none (its memory is an adapter buffer), so
  such a tensor is answered as a plain tensor is, by its storage, which names the buffer.
- torch's own Dynamo traces Python frames: its trace rules skip flagos's from the moment they
  are imported (runtime/_tracing.py says why), without importing Dynamo at activation.
- torch's FlexAttention checks device types against a list and needs a rule per tensor subclass
  for its operators: both answered for flagos tensors (integrations/_flex_attention.py).

A library imported after activation is answered the moment its module is imported (an import
hook runs the patch right after the module's own code); one imported before is answered at
activation. Either order works.
"""
from __future__ import annotations

import importlib.abc
import logging
import os
import sys
import threading

import torch

from ..core import _state
from ..runtime import _device_module, _tracing
from ..runtime._tensor import FlagosTensor
from . import _distributed, _flex_attention

log = logging.getLogger("flagos")
_lock = threading.Lock()
_done: set[str] = set()
_replaced: dict = {}  # id(original function) -> (original, replacement), until _rebind() runs


# ---- Diffusers ----------------------------------------------------------------

def _diffusers_torch_utils(module) -> None:
    # The cache sits on TorchDeviceBackend in recent Diffusers, on get_device itself before.
    backend = getattr(module, "TorchDeviceBackend", None)
    for detect in (getattr(backend, "_detect_device_type", None), module.get_device):
        if hasattr(detect, "cache_clear"):
            detect.cache_clear()
    if getattr(module, "torch_device", None) == "cpu":
        module.torch_device = module.get_device()


def _diffusers_pipeline_utils(module) -> None:
    names = module.SUPPORTED_DEVICE_MAP  # the list object the pipelines check against
    if "flagos" not in names:
        names.insert(1, "flagos")


# ---- accelerate ---------------------------------------------------------------

def _flagos_default():
    state = _state.active_or_none()
    return _state.device() if state is not None and state.mode == "device" else None


def _accelerate_state(module) -> None:
    cls = module.PartialState
    original = cls.default_device
    if getattr(original.fget, "_flagos", False):
        return

    def default_device(self) -> torch.device:
        device = _flagos_default()
        return original.fget(self) if device is None else device

    default_device._flagos = True
    default_device.__doc__ = original.__doc__
    cls.default_device = property(default_device)
    _accelerate_distributed(cls, module.DistributedType)


def _accelerate_distributed(cls, kinds) -> None:
    """Processes started by a launcher (accelerate launch, torchrun: LOCAL_RANK is set) form a
    group on flagos: accelerate knows only the named accelerators (it would run them apart, or
    on the host), so the backend becomes `flagos.dist_backend()` ("flagos") and each process's
    device flagos:(local rank modulo the device count), as accelerate spreads processes over
    GPUs. The distributed type is MULTI_GPU, the one accelerate treats as data-parallel over
    devices (Accelerator.prepare wraps models in DDP)."""
    prepare, set_device = cls._prepare_backend, cls.set_device

    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend: str | None = None):
        found, kind = prepare(self, cpu, sagemaker_dp, backend)
        device = _flagos_default()
        if (device is None or cpu or sagemaker_dp or kind not in (kinds.NO, kinds.MULTI_GPU)
                or int(os.environ.get("LOCAL_RANK", -1)) == -1):
            return found, kind
        # An explicit backend other than flagos's ("gloo": accelerate then says "Your assigned
        # backend gloo is not available, please use flagos") unless it is "nccl" under the CUDA
        # redirect, which init_process_group maps to flagos's.
        if backend == "nccl" and _state.active().redirect_cuda:
            return backend, kinds.MULTI_GPU
        return _distributed.dist_backend(), kinds.MULTI_GPU

    def _set_device(self) -> None:
        backend = getattr(self, "backend", None)
        if self.device is None and _flagos_default() is not None and (
                backend == _distributed.BACKEND or (backend == "nccl" and _state.active().redirect_cuda)):
            index = self.local_process_index % _state.active().device_count
            torch.flagos.set_device(index)
            self.device = _state.device(index)
            return
        set_device(self)

    _prepare_backend.__doc__, _set_device.__doc__ = prepare.__doc__, set_device.__doc__
    cls._prepare_backend, cls.set_device = _prepare_backend, _set_device


def _accelerate_accelerator(module) -> None:
    """Accelerator.prepare wraps a model for several devices in DDP with device_ids=[local
    rank], which is a GPU's index only where each process has the GPU of its rank. On flagos a
    process's device is flagos:(local rank % device count) (flagos:0 for every process on the
    cpu chip), so DDP is given that device's index, as accelerate does for HPUs."""
    cls = module.Accelerator
    original = cls.prepare_model
    if getattr(original, "_flagos", False):
        return

    def prepare_model(self, model, *args, **kwargs):
        model = original(self, model, *args, **kwargs)
        ddp = torch.nn.parallel.DistributedDataParallel
        device = self.device
        if (isinstance(model, ddp) and device.type == "flagos" and model.device_ids
                and model.device_ids != [device.index]):
            model.device_ids, model.output_device = [device.index], device.index
        return model

    prepare_model._flagos = True
    prepare_model.__doc__ = original.__doc__
    prepare_model.__wrapped__ = original
    cls.prepare_model = prepare_model
    _fp16_on_flagos(cls)


def _fp16_on_flagos(cls) -> None:
    """`Accelerator(mixed_precision="fp16")` checks the device type against a list of names
    written into `__init__` (cuda, npu, xpu, ...) and refuses flagos. The list is a constant of
    that function's code, so flagos's name joins it there: the code itself is unchanged, and
    flagos then gets what those devices get, float16 autocast and a GradScaler (its own:
    get_grad_scaler below)."""
    name = torch._C._get_privateuse1_backend_name()
    code = cls.__init__.__code__
    consts = tuple(c + (name,) if isinstance(c, tuple) and "cuda" in c and "npu" in c and name not in c
                   else c for c in code.co_consts)
    if consts != code.co_consts:
        cls.__init__.__code__ = code.replace(co_consts=consts)


def _accelerate_modeling(module) -> None:
    original = module.get_max_memory
    if getattr(original, "_flagos", False):
        return

    def get_max_memory(max_memory=None):
        state = _state.active_or_none()
        if state is None or state.mode != "device":
            return original(max_memory)
        return _flagos_max_memory(state, max_memory, module.convert_file_size_to_int)

    get_max_memory._flagos = True
    get_max_memory.__doc__ = original.__doc__
    get_max_memory.__wrapped__ = original
    module.get_max_memory = get_max_memory
    _replaced[id(original)] = (original, get_max_memory)

    scaler_for = module.get_grad_scaler

    def get_grad_scaler(distributed_type=None, **kwargs):
        """A GradScaler of the flagos device where flagos is accelerate's device (accelerate
        otherwise makes CUDA's, which disables itself without CUDA: no loss scaling at all)."""
        device = _flagos_default()
        if device is None or distributed_type == module.DistributedType.FSDP:
            return scaler_for(distributed_type, **kwargs)
        return torch.amp.GradScaler(device.type, **kwargs)

    get_grad_scaler._flagos = True
    get_grad_scaler.__doc__, get_grad_scaler.__wrapped__ = scaler_for.__doc__, scaler_for
    module.get_grad_scaler = get_grad_scaler
    _replaced[id(scaler_for)] = (scaler_for, get_grad_scaler)


def _rebind() -> None:
    """Modules that imported a replaced function by name before activation (transformers,
    Diffusers, a script's own `from accelerate.utils import get_max_memory`) get its
    replacement. Modules imported later find the replacement where they import it from."""
    if not _replaced:
        return
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for key, value in list(names.items()):
            pair = _replaced.get(id(value))
            if pair is not None and pair[0] is value:
                names[key] = pair[1]
    _replaced.clear()


def _flagos_max_memory(state, max_memory, to_bytes) -> dict:
    """accelerate's get_max_memory for flagos: {0: free bytes of flagos:0, ..., "cpu": ...}."""
    if max_memory is None:
        import psutil

        free = {i: torch.flagos.mem_get_info(i)[0] for i in range(state.device_count)}
        return {**free, "cpu": psutil.virtual_memory().available}
    out = {k: to_bytes(v) if isinstance(v, str) else v for k, v in max_memory.items()}
    devices = sorted(k for k in out if isinstance(k, int))
    for index in devices:
        if not 0 <= index < state.device_count:
            raise ValueError(f"max_memory names device {index}, but flagos has {state.device_count} "
                             f"device(s) on chip '{state.chip.name}': use indices 0 to "
                             f"{state.device_count - 1}, 'cpu' and 'disk'")
    unknown = [k for k in out if not isinstance(k, int) and k not in ("cpu", "disk")]
    if unknown:
        raise ValueError(f"max_memory names {unknown}; with flagos active its keys are device "
                         f"indices (flagos:N), 'cpu' and 'disk'")
    return {k: out[k] for k in devices + [k for k in ("cpu", "disk") if k in out]}


# ---- safetensors ---------------------------------------------------------------

def _is_flagos(device) -> bool:
    try:
        return isinstance(device, (str, torch.device)) and torch.device(device).type == "flagos"
    except RuntimeError:  # not a device name at all: safetensors says so in its own words
        return False


def _safetensors_torch(module) -> None:
    original = module.load_file

    def load_file(filename, device="cpu", **kwargs):
        if not _is_flagos(device):
            return original(filename, device, **kwargs)
        return {k: v.to(device) for k, v in original(filename, "cpu", **kwargs).items()}

    load_file.__doc__ = original.__doc__
    load_file.__wrapped__ = original
    module.load_file = load_file
    _replaced[id(original)] = (original, load_file)


# ---- huggingface_hub ------------------------------------------------------------

def _on_adapter_buffer(tensor) -> bool:
    return isinstance(tensor, FlagosTensor) and not isinstance(tensor._payload, torch.Tensor)


def _huggingface_hub_torch(module) -> None:
    unique_id, storage_size, is_complete = (module._get_unique_id, module.get_torch_storage_size,
                                            module._is_complete)

    def _get_unique_id(tensor):
        if _on_adapter_buffer(tensor):
            return tensor.untyped_storage().data_ptr()
        return unique_id(tensor)

    def get_torch_storage_size(tensor) -> int:
        if _on_adapter_buffer(tensor):
            return tensor.untyped_storage().nbytes()
        return storage_size(tensor)

    def _is_complete(tensor) -> bool:
        if _on_adapter_buffer(tensor):
            storage = tensor.untyped_storage()
            return (tensor.data_ptr() == storage.data_ptr()
                    and tensor.nelement() * tensor.element_size() == storage.nbytes())
        return is_complete(tensor)

    for original, replacement in ((unique_id, _get_unique_id), (storage_size, get_torch_storage_size),
                                  (is_complete, _is_complete)):
        replacement.__doc__ = original.__doc__
        replacement.__wrapped__ = original
        setattr(module, original.__name__, replacement)
        _replaced[id(original)] = (original, replacement)


# ---- transformers ---------------------------------------------------------------

def _transformers_training_args(module) -> None:
    cls = module.TrainingArguments
    cached = vars(cls)["_setup_devices"]  # a functools.cached_property
    original = cached.func
    if getattr(original, "_flagos", False):
        return

    def _setup_devices(self) -> torch.device:
        device = original(self)
        state = self.distributed_state
        if (_flagos_default() is None or self.use_cpu or state is None
                or state.distributed_type.name != "NO" or os.environ.get("ACCELERATE_TORCH_DEVICE")):
            return device
        self._n_gpu = 1  # one device, as for an XPU or NPU (no DataParallel)
        return state.device  # flagos: where the Trainer's accelerate places the model

    _setup_devices._flagos = True
    _setup_devices.__doc__ = original.__doc__
    replacement = type(cached)(_setup_devices)
    replacement.__set_name__(cls, "_setup_devices")
    cls._setup_devices = replacement
    # `bf16=True` is refused unless a named accelerator says it has bfloat16: the chip says it,
    # as `torch.cuda.is_bf16_supported()` does for a GPU (native bfloat16; sim's is not).
    bf16_available = module.is_torch_bf16_gpu_available

    def is_torch_bf16_gpu_available() -> bool:
        state = _state.active_or_none()
        if state is not None and state.mode == "device":
            return _device_module.is_bf16_supported()
        return bf16_available()

    is_torch_bf16_gpu_available.__doc__ = bf16_available.__doc__
    module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available


def _transformers_pipelines(module) -> None:
    cls = module.Pipeline
    original = cls.__init__
    if getattr(original, "_flagos", False):
        return
    positional_device = 7  # model, tokenizer, feature_extractor, image_processor, processor, modelcard, task

    def __init__(self, *args, **kwargs):
        flagos = _flagos_default()
        if flagos is not None and len(args) <= positional_device:
            device = kwargs.get("device")
            model = args[0] if args else kwargs.get("model")
            if device is None and getattr(model, "hf_device_map", None) is None:
                device = 0  # the pipeline's own default: the first accelerator
            if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
                kwargs["device"] = torch.device(flagos.type, device)
        original(self, *args, **kwargs)

    __init__._flagos = True
    __init__.__doc__, __init__.__wrapped__ = original.__doc__, original
    cls.__init__ = __init__


_PATCHES = {
    "diffusers.utils.torch_utils": _diffusers_torch_utils,
    "diffusers.pipelines.pipeline_utils": _diffusers_pipeline_utils,
    "accelerate.state": _accelerate_state,
    "accelerate.accelerator": _accelerate_accelerator,
    "accelerate.utils.modeling": _accelerate_modeling,
    "safetensors.torch": _safetensors_torch,
    "huggingface_hub.serialization._torch": _huggingface_hub_torch,
    "transformers.training_args": _transformers_training_args,
    "transformers.pipelines.base": _transformers_pipelines,
    # Dynamo's own rules: flagos's frames are skipped from the moment Dynamo exists
    "torch._dynamo.trace_rules": _tracing.skip_flagos_frames,
    # FlexAttention's device check and its operators' rules for flagos tensors
    "torch._higher_order_ops.flex_attention": _flex_attention.register_operator_rules,
    "torch.nn.attention.flex_attention": _flex_attention.check_devices_of_payloads,
}


def _patch(name: str, module) -> None:
    with _lock:
        if name in _done:
            return
        _done.add(name)
    try:
        _PATCHES[name](module)
    except (AttributeError, TypeError) as e:  # another version of the library: never break its import
        log.warning("flagos could not answer %s's device detection (%s: %s); pass "
                    "flagos.device() to it explicitly", name, type(e).__name__, e)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules above, wraps the real loader so the patch runs
    right after the module's own code, before anything can import names from it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES or fullname in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                _patch(fullname, module)
                _replaced.clear()  # imported just now: nothing else holds the originals yet

            def __getattr__(self, name):  # get_source, is_package, resource readers, ...
                return getattr(real, name)

        spec.loader = Loader()
        return spec


_hook = _AfterImport()


def install() -> None:
    """Answer the libraries already imported now, and the others when they are imported."""
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
    for name in _PATCHES:
        module = sys.modules.get(name)
        if module is not None:
            _patch(name, module)
    _rebind()  # only what was imported before activation can hold the originals
