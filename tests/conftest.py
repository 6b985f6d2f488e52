"""pytest set-up shared by every test file."""

import os
import tempfile

# Our tests run strict: a graph our wrapper cannot handle raises instead of
# falling back to the Python wrapper (torch_cppwrap.config.strict).  Set
# before any test imports torch_cppwrap, and inherited by the subprocesses
# tests start.
os.environ.setdefault("TORCH_CPPWRAP_STRICT", "1")

# Nothing the tests build lands in the user's own caches: Inductor's cache,
# which holds torch_cppwrap's, is one directory under the system's temporary
# directory (tests.common.SUITE_CACHE), kept between runs so that the runtime
# extension and precompiled headers are built once.  Upstream's TestCase
# gives each test a fresh cache; tests.common.seed_cache() links them in.
_TEST_CACHE = os.path.join(tempfile.gettempdir(), f"torch_cppwrap-tests-{os.getuid()}")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_TEST_CACHE, "inductor"))
# Tools that cache under the user's home by default follow it there too
# (Triton's kernel cache, ~/.triton; anything that honours XDG, ~/.cache).
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_TEST_CACHE, "triton"))
os.environ.setdefault("XDG_CACHE_HOME", os.path.join(_TEST_CACHE, "xdg-cache"))
# The runtime extension `python -m torch_cppwrap build` installs is looked for
# here, not in the package: a developer's installed one does not stand in for
# the builds the tests check, and the tests install into temporary directories.
# Set whatever the environment says: one the caller set for the benchmark
# (scripts/gpu) stood in for the suite cache's, which the tests link into
# their fresh caches from there, and failed 185 tests on the H200.
os.environ["TORCH_CPPWRAP_INSTALLED_RUNTIME_DIR"] = os.path.join(
    _TEST_CACHE, "installed-runtime"
)
