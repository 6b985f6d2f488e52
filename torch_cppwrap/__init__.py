"""torch_cppwrap: TorchInductor's host wrapper as C++, generated and built by us.

Importing the package patches ``torch._inductor`` (see :func:`patch`); with
``torch._inductor.config.cpp_wrapper = True`` every graph compiled for the CPU
then gets torch_cppwrap's C++ wrapper.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

__all__ = ["__version__", "get_original", "is_patched", "patch", "unpatch"]
__version__ = "0.1.0"

_PATCHING_API = ("get_original", "is_patched", "patch", "unpatch")
_COMMAND_MODULES = ("torch_cppwrap", "torch_cppwrap.__main__")


def _started_as_command() -> bool:
    """Whether this import is the command line starting (``python -m
    torch_cppwrap`` or the ``torch-cppwrap`` script).  The command line then
    imports torch, and patches it, only for a command that needs it, so that
    ``--help`` and ``--version`` answer without the seconds torch takes."""
    if sys.argv[:1] == ["-m"]:  # runpy is still importing the -m module
        args = getattr(sys, "orig_argv", [])
        for i, arg in enumerate(args):
            if arg == "-m":
                return args[i + 1 : i + 2] in ([m] for m in _COMMAND_MODULES)
            if arg.startswith("-m"):
                return arg[2:] in _COMMAND_MODULES
        return False
    return os.path.basename(sys.argv[0]) == "torch-cppwrap" if sys.argv else False


def _patch_if_supported() -> None:
    """What importing the package does: patch Inductor, or warn and leave it
    alone on a torch release we do not support."""
    import torch

    from torch_cppwrap import _compat, _patching

    if _compat.torch_is_supported():
        _patching.patch()
    else:
        warnings.warn(
            f"torch_cppwrap supports torch {_compat.supported_range_text()}, but "
            f"torch {torch.__version__} is installed; nothing was patched and "
            "Inductor keeps its own C++ wrapper.",
            RuntimeWarning,
            stacklevel=3,
        )


if TYPE_CHECKING:
    from torch_cppwrap._patching import get_original, is_patched, patch, unpatch


def __getattr__(name: str) -> Any:
    # The patching API, for the command line, which imported us without it.
    if name in _PATCHING_API:
        from torch_cppwrap import _patching

        return getattr(_patching, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_as_command():
    from torch_cppwrap._patching import get_original, is_patched, patch, unpatch

    _patch_if_supported()
