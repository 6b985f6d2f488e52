"""pytest set-up shared by every test file."""

import os

# Our tests run strict: a graph our wrapper cannot handle raises instead of
# falling back to the Python wrapper (torch_cppwrap.config.strict).  Set
# before any test imports torch_cppwrap, and inherited by the subprocesses
# tests start.
os.environ.setdefault("TORCH_CPPWRAP_STRICT", "1")
