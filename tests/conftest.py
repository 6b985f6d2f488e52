"""pytest set-up shared by every test file."""

import os
import tempfile

# Our tests run strict: a graph our wrapper cannot handle raises instead of
# falling back to the Python wrapper (torch_cppwrap.config.strict).  Set
# before any test imports torch_cppwrap, and inherited by the subprocesses
# tests start.
os.environ.setdefault("TORCH_CPPWRAP_STRICT", "1")

# Nothing the tests build lands in the user's own caches: one directory under
# the system's temporary directory, kept between runs so that the runtime
# extension and precompiled headers are built once.
_TEST_CACHE = os.path.join(tempfile.gettempdir(), f"torch_cppwrap-tests-{os.getuid()}")
os.environ.setdefault("TORCH_CPPWRAP_CACHE_DIR", os.path.join(_TEST_CACHE, "cppwrap"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_TEST_CACHE, "inductor"))
