"""Tensor subclasses of the program's own (`__torch_function__` subclasses: torchvision's
tv_tensors, a class that tags tensors) holding flagos tensors.

PyTorch makes such an object with `tensor.as_subclass(cls)`: a new Python object of class `cls`
over an alias of the tensor. A flagos alias already has its Python object, a FlagosTensor, so
PyTorch refuses ("Creating a new Tensor subclass Tagged but the raw Tensor object is already
associated to a python object of type FlagosTensor"), and `tagged.to(flagos.device())` failed.
Here the alias takes a class that is both: `cls` first (its methods and attributes, `isinstance`),
then FlagosTensor (the dispatch to the chip). Its `__torch_function__` is the user class's, run
as for the user class itself, so results leaving flagos (`.cpu()`) are plain `cls` objects again.
"""
from __future__ import annotations

import functools

import torch

_PLAIN_DISPATCH = vars(torch.Tensor)["__torch_dispatch__"]  # PyTorch's "no dispatch of its own"
_PLAIN_FUNCTION = torch._C._disabled_torch_function_impl


def _raw(cls: type, name: str):
    """`name` as the first class in cls's MRO that defines it holds it (a classmethod object,
    not a bound method)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


@functools.cache
def holding_flagos(cls: type, flagos_type: type) -> type:
    """The class of a `cls` object whose tensor is a flagos tensor (one per user class)."""
    if _raw(cls, "__torch_dispatch__") is not _PLAIN_DISPATCH:
        raise TypeError(
            f"{cls.__qualname__} has a __torch_dispatch__ of its own, and a flagos tensor runs "
            f"flagos's: such a subclass cannot hold one. Make it over host tensors, or give it "
            f"__torch_function__ only.")
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "_flagos_user_class": cls}
    raw_function = _raw(cls, "__torch_function__")
    if raw_function is not _PLAIN_FUNCTION:  # (a class that turns it off keeps it off)
        user_function = raw_function.__get__(None, cls)  # bound to cls itself

        def __torch_function__(combined, func, types, args=(), kwargs=None):
            # As for a `cls` object: PyTorch's conversion of results then asks for `cls`,
            # which a flagos result answers with this class again (FlagosTensor.as_subclass).
            types = tuple(cls if t is combined else t for t in types)
            return user_function(func, types, args, kwargs)

        namespace["__torch_function__"] = classmethod(__torch_function__)
    return type(cls.__name__, (cls, flagos_type), namespace)


def user_class(holder: type) -> type | None:
    """The program's class a holder class stands for (None for any other class): what a pickle
    of the tensor names, so it loads as that class, as from the CPU."""
    return vars(holder).get("_flagos_user_class")
