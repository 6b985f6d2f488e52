# Set-up shared by the device scripts (sourced from the repository root):
# $OUT, $PYTHON, the carried wheels, the repo on PYTHONPATH, Inductor's cache.
OUT=${OUT:-/tmp/cppwrap_gpu_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
# Pure-Python test dependencies the GPU image lacks (expecttest), carried as
# wheels in .whl/ (see the device README).
if compgen -G ".whl/*.whl" >/dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# Inductor's cache holds torch_cppwrap's too (runtime extension, precompiled
# headers); the tests link those into the fresh cache each test gets.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache_tests}
# The image keeps no bytecode for most of its Python: every process compiled
# some 2,300 modules from source as it imported them (7.5 s of a cProfiled
# cold compile in session 26), in every mode, cold and warm alike.  A user's
# installation has its bytecode, so keep it, under /tmp, for every process of
# the call after the first.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/cppwrap_pycache}
unset PYTHONDONTWRITEBYTECODE
