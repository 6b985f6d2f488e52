"""torch_cppwrap: TorchInductor's host wrapper as C++, generated and built by us.

Importing the package patches ``torch._inductor`` (see :func:`patch`); with
``torch._inductor.config.cpp_wrapper = True`` every graph compiled for the CPU
then gets torch_cppwrap's C++ wrapper.
"""

from __future__ import annotations

import warnings

import torch

from torch_cppwrap import _compat
from torch_cppwrap._patching import get_original, is_patched, patch, unpatch

__all__ = ["__version__", "get_original", "is_patched", "patch", "unpatch"]
__version__ = "0.1.0"

if _compat.torch_is_supported():
    patch()
else:
    warnings.warn(
        f"torch_cppwrap supports torch {_compat.supported_range_text()}, but torch "
        f"{torch.__version__} is installed; nothing was patched and Inductor keeps "
        "its own C++ wrapper.",
        RuntimeWarning,
        stacklevel=2,
    )
