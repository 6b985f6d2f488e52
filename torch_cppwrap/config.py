"""torch_cppwrap's settings, in the shape of ``torch/_inductor/config.py``.

Each entry's default may come from an environment variable; change entries in
code with ``torch_cppwrap.config.patch(...)`` (a context manager and
decorator), as with Inductor's config.
"""

import os
import sys
from typing import TYPE_CHECKING

from torch.utils._config_module import install_config_module

# A graph our C++ wrapper cannot generate or build is compiled with Inductor's
# Python wrapper instead, with one line on the ``perf_hints`` log naming the
# reason.  Strict mode raises the error instead: our own tests run strict.
strict: bool = os.environ.get("TORCH_CPPWRAP_STRICT", "0") == "1"

# The code cache has no settings of its own: it lives in Inductor's cache
# directory and follows Inductor's settings, torch._inductor.config's
# ``cpp_cache_precompile_headers`` (TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS)
# for precompiled headers and ``file_lock_timeout``
# (TORCHINDUCTOR_FILE_LOCK_TIMEOUT) for how long to wait for another process's
# build.

if TYPE_CHECKING:
    from torch.utils._config_typing import *  # noqa: F403

# adds patch, save_config, etc.
install_config_module(sys.modules[__name__])
