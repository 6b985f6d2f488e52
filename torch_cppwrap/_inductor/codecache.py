"""Building and loading the C++ that torch_cppwrap generates.

Everything lives in Inductor's cache directory, under ``<cache_dir>/cppwrap``,
so that ``TORCHINDUCTOR_CACHE_DIR`` moves it and
``torch._inductor.utils.fresh_cache()`` starts it afresh:

* ``runtime/<key>/``: the runtime extension (``runtime/cppwrap_runtime_ext.cpp``),
  the one translation unit compiled against libtorch's headers;
* ``pch/<key>/``: precompiled headers, the device's wrapper header
  (``WRAPPER_HEADERS``) for wrapper translation units and Inductor's
  ``cpp_prefix.h`` for kernel ones;
* ``<key[1:3]>/<key>/``: one graph's module, beside its sources;
* ``build-env/<stamp>.json``: what cpp_builder's options came to (compile
  commands, the compiler's version) in one build environment, so that a
  process which only loads modules need not work them out (`_BuildMemo`);
  ``python -m torch_cppwrap build`` installs one beside the runtime, which a
  new cache starts from.

A key hashes what an artefact is made of (sources, our headers, the compile
commands, the torch and compiler versions), never where the cache is: a
moved cache stays valid.

Every build is a ``cpp_builder.CppBuilder`` command, run by cpp_builder in a
private build directory beside its artefact and naming its sources and
outputs relative to that directory.  cpp_builder quotes the include
directories it writes into a command line but not file names, so a cache
path holding a space reaches the compiler only as an include directory.

Each artefact is built under its own file lock (in Inductor's lock directory,
waiting at most Inductor's ``file_lock_timeout``), renamed into place, and
then recorded, size and SHA-256, in a file beside it.  It is checked against
that record before it is used; one that fails the check is rebuilt once, with
a warning naming it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch._dynamo.utils import dynamo_timed
from torch._inductor import config as inductor_config
from torch._inductor import cpp_builder, exc
from torch._inductor.codecache import code_hash, get_lock_dir, write_atomic
from torch._inductor.utils import clear_on_fresh_cache

from torch_cppwrap import _compat

__all__ = [
    "CppWrapperCodeCache",
    "CppWrapperCompileError",
    "RuntimeExtension",
    "cache_root",
    "prepare_runtime",
    "write_atomic",
]

log = logging.getLogger(__name__)

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
RUNTIME_HEADERS = (
    "cppwrap_api.h",
    "cppwrap_dtypes.h",
    "cppwrap_sizes.h",
    "cppwrap_runtime.h",
    "cppwrap_cuda.h",
    "cppwrap_cuda_graph.h",
)
RUNTIME_SOURCE = RUNTIME_DIR / "cppwrap_runtime_ext.cpp"
# The header that heads every wrapper translation unit of a device, first, so
# that its precompiled form stands in for it: the runtime's, and for CUDA the
# CUDA graph header, which includes the CUDA header (with the CUDA C shim's
# declarations, most of what a CUDA unit parsed beyond the runtime's) and the
# runtime's.
WRAPPER_HEADERS: dict[str, str] = {
    "cpu": "cppwrap_runtime.h",
    "cuda": "cppwrap_cuda_graph.h",
}
CPP_PREFIX_INCLUDE = "torch/csrc/inductor/cpp_prefix.h"

# What a wrapper module adds to cpp_builder's CPU options, by device: the
# macros it is compiled with.  CUDA modules look the CUDA driver up at run
# time, so they need no CUDA headers or -lcuda; the aoti_torch_cuda_* shim
# they call lives in libtorch_cuda, which they reach as CPU modules reach
# libtorch_cpu (see _Toolchain.link).
DEVICE_DEFINITIONS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "cuda": ("USE_CUDA",),
}


class CppWrapperCompileError(RuntimeError):
    """A C++ build of torch_cppwrap failed.  Carries the command, the compiler's
    output and the path of the source that failed."""

    def __init__(self, cmd: Sequence[str], output: str, source_path: str) -> None:
        self.cmd = list(cmd)
        self.output = output
        self.source_path = source_path
        super().__init__(
            "torch_cppwrap: C++ compile failed\n\n"
            f"Source:\n{source_path}\n\n"
            f"Command:\n{shlex.join(self.cmd)}\n\n"
            f"Output:\n{output}"
        )

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.__class__, (self.cmd, self.output, self.source_path))


def cache_root() -> Path:
    """torch_cppwrap's part of Inductor's cache directory."""
    return Path(_compat.inductor_cache_dir()) / "cppwrap"


# Where ``python -m torch_cppwrap build`` installs the runtime extension, and
# where a compile looks for it before Inductor's cache (default: beside the
# runtime sources, in ``runtime/installed``).
INSTALLED_RUNTIME_ENV = "TORCH_CPPWRAP_INSTALLED_RUNTIME_DIR"


def installed_runtime_dir() -> Path:
    """Where the runtime extension built at install time lives: a build
    there that matches this torch and compiler spares the first compile in
    each new Inductor cache the extension's build."""
    return Path(os.environ.get(INSTALLED_RUNTIME_ENV) or RUNTIME_DIR / "installed")


def installed_or_cached(
    cached: Path,
    key: str,
    what: str,
    build: Callable[[Path, str], Path],
    *,
    install: bool = False,
) -> Path:
    """An artefact built once per cache (`cached`, under the cache root)
    that ``python -m torch_cppwrap build`` may also have installed, at the
    same place under `installed_runtime_dir()`.

    The installed one is used when it is there and intact (one that is
    damaged is passed over, with a warning); otherwise the cache's, built by
    `build(build_dir, where)` if need be.  With `install`, the installed one
    is made: copied from the cache when it holds the artefact (the same key,
    the same bytes), else built."""
    installed = installed_runtime_dir() / cached.relative_to(cache_root())
    if not install:
        damage = _damage(installed)
        if damage is None:
            return installed
        if damage is not MISSING:
            warnings.warn(
                f"torch_cppwrap: the installed {installed} {damage}; using "
                "Inductor's cache instead (`python -m torch_cppwrap build` "
                "installs it again)",
                stacklevel=3,
            )
        return ensure_built(
            cached,
            key,
            what,
            lambda build_dir: build(build_dir, "once per Inductor cache"),
        )

    def build_or_copy(build_dir: Path) -> Path:
        if _damage(cached) is None:
            shutil.copyfile(cached, build_dir / cached.name)
            return build_dir / cached.name
        return build(build_dir, "once per installation")

    return ensure_built(installed, f"installed-{key}", what, build_or_copy)


def cache_key(*parts: str) -> str:
    """Inductor's code hash of `parts`, joined as JSON so that no two lists
    of parts join alike."""
    return code_hash(json.dumps(parts))


@contextlib.contextmanager
def _first_use_step(action: str, why: str, build_dir: Path) -> Iterator[None]:
    """Says on stderr what a once-per-cache step does and how long it took:
    the first compile in a new environment pauses for a minute, and should
    say why.  Later runs find the result and say nothing.  A step whose
    build directory was removed under it (its cache deleted, as
    ``fresh_cache()`` does on exit while a prefetch still builds) was
    abandoned, not failed: that goes to the debug log only."""
    # One write per line: these steps run side by side, in threads.
    sys.stderr.write(f"torch_cppwrap: {action} ({why})...\n")
    sys.stderr.flush()
    started = time.perf_counter()
    try:
        yield
    except BaseException as error:
        elapsed = time.perf_counter() - started
        if build_dir.exists():
            lines = str(error).strip().splitlines()
            reason = lines[0] if lines else type(error).__name__
            sys.stderr.write(
                f"torch_cppwrap: {action}: failed after {elapsed:.1f} s: {reason}\n"
            )
            sys.stderr.flush()
        else:
            log.debug("torch_cppwrap: %s: abandoned, %s was removed", action, build_dir)
        raise
    elapsed = time.perf_counter() - started
    sys.stderr.write(f"torch_cppwrap: {action}: done in {elapsed:.1f} s\n")
    sys.stderr.flush()


def _submit(
    pool: concurrent.futures.Executor, work: Callable[..., Any], *args: Any
) -> concurrent.futures.Future[Any]:
    """`pool.submit(work, *args)` in a copy of the caller's context: Inductor's
    config is per thread (context variables), and a build must see the
    settings of the compile it serves."""
    return pool.submit(contextvars.copy_context().run, work, *args)


@contextlib.contextmanager
def _alongside(work: Callable[[], object]) -> Iterator[None]:
    """Runs `work` in a thread while the body runs; raises its error after."""
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="torch_cppwrap"
    ) as pool:
        future = _submit(pool, work)
        yield
        future.result()


# ---------------------------------------------------------------------------
# Artefacts: built once under a lock, recorded, checked before use
# ---------------------------------------------------------------------------

MISSING = "is missing"


def _record_path(artefact: Path) -> Path:
    return artefact.with_name(artefact.name + ".record")


def _file_sha256(path: Path) -> str:
    # Inductor's hash helpers take the content in memory; a precompiled
    # header runs to 150 MB, so files are hashed as a stream.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Files this process found as recorded, by identity, size and modification
# time: a precompiled header is hashed once per process, not once per graph.
# (Not the change time: linking a file, as the tests do, changes it.)
_intact_lock = threading.Lock()
_intact: set[tuple[int, ...]] = set()


def _damage(artefact: Path) -> str | None:
    """None if `artefact` is as recorded when it was built; else what is
    wrong with it (MISSING if it was never built)."""
    try:
        stat = artefact.stat()
    except FileNotFoundError:
        return MISSING
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _intact_lock:
        if identity in _intact:
            return None
    size = stat.st_size
    try:
        record = json.loads(_record_path(artefact).read_text())
        recorded_size, recorded_sha256 = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        # A build killed between renaming the artefact and recording it.
        return "has no readable record of its build"
    if size != recorded_size:
        return f"is {size} bytes long, {recorded_size} when it was built"
    if _file_sha256(artefact) != recorded_sha256:
        return "differs from what was built (SHA-256 mismatch)"
    with _intact_lock:
        _intact.add(identity)
    return None


@contextlib.contextmanager
def _file_lock(key: str, what: str) -> Iterator[None]:
    """The lock that one process holds while it builds the artefact `key`.
    An OS-level (fcntl) lock: a process killed mid-build leaves nothing that
    blocks the next one."""
    from filelock import Timeout
    from torch.utils._filelock import FileLock

    timeout = inductor_config.file_lock_timeout
    lock = FileLock(os.path.join(get_lock_dir(), f"cppwrap-{key}.lock"), timeout)
    acquired = False
    try:
        with lock:
            acquired = True
            yield
    except Timeout:
        if acquired:  # a nested lock's timeout, reported by its own holder
            raise
        raise RuntimeError(
            f"torch_cppwrap: timed out after {timeout} s waiting for another "
            f"process to build {what}; torch._inductor.config.file_lock_timeout "
            "(TORCHINDUCTOR_FILE_LOCK_TIMEOUT) says how long to wait"
        ) from None


def ensure_built(
    artefact: Path, key: str, what: str, build: Callable[[Path], Path]
) -> Path:
    """Returns `artefact`, intact, after building it with `build(build_dir)
    -> built file` if it is missing or damaged.

    One process builds, the others wait on the lock and then find it built.
    Inside the lock no one else builds this key, so build directories left
    beside the artefact are a killed process's leftovers, and are removed.
    """
    if _damage(artefact) is None:
        return artefact
    artefact.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(key, what):
        damage = _damage(artefact)  # a second look: built while we waited?
        if damage is None:
            return artefact
        if damage is not MISSING:
            warnings.warn(
                f"torch_cppwrap: {artefact} {damage}; rebuilding it", stacklevel=2
            )
        for leftover in artefact.parent.glob(".build-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        build_dir = Path(tempfile.mkdtemp(prefix=".build-", dir=artefact.parent))
        try:
            started = time.perf_counter()
            built = build(build_dir)
            record = {"size": built.stat().st_size, "sha256": _file_sha256(built)}
            os.replace(built, artefact)
            write_atomic(str(_record_path(artefact)), json.dumps(record))
            log.info(
                "torch_cppwrap: built %s in %.1f s", what, time.perf_counter() - started
            )
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return artefact


def _load_extension(module_name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load_graph_module(graph: GraphBuild) -> ModuleType:
    # Every wrapper module's initialiser is PyInit_cppwrap_graph (a fixed
    # name keeps the precompiled header valid); the path tells them apart,
    # and multi-phase initialisation gives each load a module of its own,
    # with state of its own (cppwrap::ModuleState).
    module = _load_extension("cppwrap_graph", graph.module_path)
    module.__cppwrap_source_dir__ = str(graph.directory)  # type: ignore[attr-defined]
    return module


# ---------------------------------------------------------------------------
# Builds, as cpp_builder expresses them
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Build:
    """One compiler run: ``CppBuilder(name, sources, options)`` with an empty
    output_dir, run in a build directory, so that its output lands there as
    `name` plus cpp_builder's extension (.o, .so, .gch).

    `include_dirs` (searched first), `definitions` and `ldflags` are ours,
    added to the options cpp_builder made: its option classes compute their
    lists in their constructors and take no additions, so the two are merged
    into a plain ``BuildOptionsBase``.  `kept_libraries`, when given, are the
    only ones of cpp_builder's libraries linked.
    """

    name: str
    sources: tuple[str, ...]
    # The keyword arguments of cpp_builder's options (see `options`).
    spec: tuple[tuple[str, Any], ...]
    include_dirs: tuple[str, ...] = ()
    definitions: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    kept_libraries: tuple[str, ...] | None = None

    @functools.cached_property
    def options(self) -> Any:
        """cpp_builder's options for a CPU build with `spec`: made when a
        command is needed, not to compute a key (see `fingerprint`)."""
        return _compat.build_options(device_type="cpu", **dict(self.spec))

    def with_include_dir(self, directory: str | Path | None) -> Build:
        if directory is None:
            return self
        return dataclasses.replace(
            self, include_dirs=(str(directory), *self.include_dirs)
        )

    def builder(self, include_dirs: Sequence[str] | None = None) -> Any:
        base = self.options
        options = cpp_builder.BuildOptionsBase(
            compiler=base.get_compiler(),
            definitions=[*base.get_definitions(), *self.definitions],
            include_dirs=[
                *(self.include_dirs if include_dirs is None else include_dirs),
                *base.get_include_dirs(),
            ],
            cflags=base.get_cflags(),
            ldflags=[*base.get_ldflags(), *self.ldflags],
            libraries_dirs=base.get_libraries_dirs(),
            libraries=[
                library
                for library in base.get_libraries()
                if self.kept_libraries is None or library in self.kept_libraries
            ],
            passthrough_args=base.get_passthrough_args(),
            aot_mode=base.get_aot_mode(),
            use_relative_path=base.get_use_relative_path(),
            compile_only=base.get_compile_only(),
            precompiling=base.get_precompiling(),
            preprocessing=base.get_preprocessing(),
        )
        return cpp_builder.CppBuilder(
            name=self.name, sources=list(self.sources), BuildOption=options
        )

    def command(self) -> str:
        """The command line, include directories and all.  Remembered per
        build environment (see `_BuildMemo`): the include directories are
        the installed or cached precompiled headers', the same paths in
        every process of that cache or installation."""
        return _BuildMemo.get(
            f"command line {self._described()} {self.include_dirs!r}",
            lambda: self.builder().get_command_line(),
        )

    def fingerprint(self) -> str:
        """The command without our include directories: what a key hashes.
        Those directories are cache paths or ours, and their content is
        hashed on its own.  Remembered per build environment (see
        `_BuildMemo`)."""
        return _BuildMemo.get(
            f"command {self._described()}",
            lambda: self.builder(include_dirs=()).get_command_line(),
        )

    def _described(self) -> str:
        spec = sorted((name, str(value)) for name, value in self.spec)
        return repr(
            (
                self.name,
                self.sources,
                spec,
                self.definitions,
                self.ldflags,
                self.kept_libraries,
            )
        )

    @property
    def output(self) -> str:
        return _BuildMemo.get(
            f"output {self._described()}", lambda: self.builder().get_target_file_path()
        )

    def run(self, build_dir: Path, source_path: str | Path) -> Path:
        """Runs the build in `build_dir`; returns the path of its output."""
        try:
            cpp_builder.run_compile_cmd(self.command(), cwd=str(build_dir))
        except exc.CppCompileError as e:
            raise CppWrapperCompileError(e.cmd, e.output, str(source_path)) from None
        return build_dir / self.output


def loaded_library(stem: str) -> list[str]:
    """[path] of the shared library this process loaded whose file name
    starts with `stem`, or [] where that cannot be told (not Linux, or none)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(stem) and os.path.isfile(path):
                    return [path]
    except OSError:
        pass
    return []


class _Toolchain:
    """How each of torch_cppwrap's builds is expressed with cpp_builder's
    options.  Options are made afresh for each build, as they follow
    Inductor's config."""

    @property
    def vec_isa(self) -> Any:
        """The vector ISA Inductor generates kernels for under the config of
        the moment (``cpp.simdlen`` picks it, compile by compile): kernels
        built for another ISA than their code's read and write past their
        buffers.  Inductor probes the machine once and keeps the answer."""
        return _compat.pick_vec_isa()

    @staticmethod
    def _options(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
        from torch._inductor.cpu_vec_isa import invalid_vec_isa

        kwargs.setdefault("vec_isa", invalid_vec_isa)
        return tuple(sorted(kwargs.items()))

    def wrapper_compile(
        self,
        device_type: str,
        source: str,
        *,
        precompiling: bool = False,
        name: str = "wrapper",
    ) -> Build:
        """A wrapper translation unit (or, named "launchers", the Triton
        launchers beside it): light headers (ours, Python.h, the C shim), no
        vector ISA, Inductor's wrapper optimisation level."""
        definitions = DEVICE_DEFINITIONS[device_type]
        options = self._options(
            min_optimize=True, compile_only=not precompiling, precompiling=precompiling
        )
        if precompiling:
            name = "header"
        return Build(name, (source,), options, (str(RUNTIME_DIR),), definitions)

    def kernel_compile(self, source: str, *, precompiling: bool = False) -> Build:
        """A kernel translation unit: Inductor's kernels, built as Inductor
        builds them, for the machine's vector ISA."""
        options = self._options(
            vec_isa=self.vec_isa,
            compile_only=not precompiling,
            precompiling=precompiling,
        )
        return Build("header" if precompiling else "kernels", (source,), options)

    # What a graph module links of cpp_builder's libraries: libtorch.so,
    # which names libtorch_cpu (and, in a CUDA build, libtorch_cuda) as its
    # own dependencies.  The loader looks the module's C shim calls up among
    # those, which the process has loaded already, and the linker reads none
    # of their symbol tables: libtorch_cpu's cost 0.3 s of every graph's
    # link, and 0.7 s with libtorch_cuda's.  --no-as-needed keeps
    # libtorch.so, none of whose own symbols a module uses, among the
    # module's dependencies.
    MODULE_LIBRARIES = ("torch", "gomp")
    MODULE_LDFLAGS = ("Wl,--no-as-needed",)

    def link(self, objects: Sequence[str]) -> Build:
        """A graph module's link, the same for every device."""
        sources = (*objects, *self.shared_libstdcxx)
        return Build(
            "module",
            sources,
            self._options(),
            ldflags=self.MODULE_LDFLAGS,
            kept_libraries=self.MODULE_LIBRARIES,
        )

    def runtime_extension(self) -> Build:
        """The runtime extension: libtorch's headers, Inductor's wrapper
        optimisation level.  Parsing the headers is most of its minute on a
        cold cache; -O3 would add a fifth to that for code that only moves
        handles and calls into libtorch, where the work is."""
        return Build(
            "runtime",
            (RUNTIME_SOURCE.name, *self.shared_libstdcxx),
            self._options(include_pytorch=True, min_optimize=True),
            (str(RUNTIME_DIR),),
        )

    @functools.cached_property
    def shared_libstdcxx(self) -> tuple[str, ...]:
        """The C++ runtime libtorch uses, linked by path.  Our modules pass
        exceptions and strings to and from libtorch, so they must share its
        libstdc++; some toolchains (the GPU machine's g++) link a static copy
        by default, whose iostreams and exception_ptr crash or misbehave
        beside libtorch's."""
        return tuple(loaded_library("libstdc++.so"))


_toolchain_lock = threading.Lock()
_toolchain: _Toolchain | None = None


def toolchain() -> _Toolchain:
    global _toolchain
    with _toolchain_lock:
        if _toolchain is None:
            _toolchain = _Toolchain()
        return _toolchain


def _compiler_version() -> str:
    return _BuildMemo.get(
        "compiler version",
        lambda: cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler()),
    )


# Environment variables that cpp_builder or the compiler read, by name and by
# prefix: part of the build environment's stamp.  Inductor's config, which
# its own environment variables set, is stamped apart; other variables (the
# cache's place, the switches of a benchmark or a test) change no command.
_BUILD_ENV_NAMES = frozenset(
    (
        "CC",
        "CXX",
        "CFLAGS",
        "CXXFLAGS",
        "CPPFLAGS",
        "LDFLAGS",
        "CPATH",
        "C_INCLUDE_PATH",
        "CPLUS_INCLUDE_PATH",
        "LIBRARY_PATH",
        "LD_LIBRARY_PATH",
        "PATH",
        "OMP_PREFIX",
        "ATEN_CPU_CAPABILITY",
        "TORCHINDUCTOR_DEBUG_COMPILE",
        "TORCHINDUCTOR_DEBUG_SYMBOL",
        "TORCH_INDUCTOR_INSTALL_GXX",
    )
)
_BUILD_ENV_PREFIXES = ("CUDA", "ROCM", "CONDA", "GCC_")
_BUILD_CONFIG_PREFIXES = (
    "cpp.",
    "aot_inductor.",
    "test_configs.",
    "cpp_cache_precompile_headers",
)


# Stamps already worked out in this process, by the config entries and the
# environment variables they stamp.
_stamps: dict[tuple[Any, ...], str] = {}


@functools.cache
def _build_config_names() -> tuple[str, ...]:
    """The entries of Inductor's config that cpp_builder reads, by prefix."""
    return tuple(
        sorted(
            name
            for name in inductor_config.save_config_portable()
            if name.startswith(_BUILD_CONFIG_PREFIXES)
        )
    )


def _environment_stamp() -> str:
    """A digest of what cpp_builder's options and the compiler's identity
    follow: torch, Python, the parts of Inductor's config that cpp_builder
    reads, the environment variables it and the compiler read, and the
    compilers that config names as found on the PATH (path, size and
    modification time).  Cheap: nothing here runs the compiler, and a
    process works it out once per config and environment."""
    environ = tuple(
        sorted(
            (name, value)
            for name, value in os.environ.items()
            if name in _BUILD_ENV_NAMES or name.startswith(_BUILD_ENV_PREFIXES)
        )
    )
    # Only what cpp_builder reads: a compile patches other parts (triton.*),
    # which a later process that loads its modules does not.  By value, not
    # by Inductor's config hash, which stays as it is while AOTInductor fills
    # aot_inductor.metadata in place.
    config = repr(
        [(name, getattr(inductor_config, name)) for name in _build_config_names()]
    )
    seen = (config, environ)
    stamp = _stamps.get(seen)
    if stamp is not None:
        return stamp
    compilers = []
    for name in (*inductor_config.cpp.cxx, os.environ.get("CXX")):
        found = shutil.which(name) if name else None
        if found:
            real = os.path.realpath(found)
            stat = os.stat(real)
            compilers.append((name, real, stat.st_size, stat.st_mtime_ns))
    stamp = _stamps[seen] = cache_key(
        torch.__version__,
        torch.__file__,
        sys.executable,
        sys.version,
        config,
        repr(environ),
        repr(compilers),
    )
    return stamp


class _BuildMemo:
    """What cpp_builder's options came to (commands, the compiler's
    version), kept in the cache per build environment.  Keys hash them, and
    working them out runs the compiler and, the first time in a process,
    imports torch.utils.cpp_extension and setuptools: 0.2-0.4 s that a
    process which only loads built modules (an FX graph cache hit) would pay
    and the Python wrapper never does.  A process in an environment with
    another stamp works them out again.  An unreadable file counts as empty."""

    _lock = threading.Lock()
    _entries: dict[Path, dict[str, str]] = {}

    @staticmethod
    def _paths() -> tuple[Path, Path]:
        """This environment's record in the cache and in the installation."""
        name = Path("build-env") / f"{_environment_stamp()}.json"
        return cache_root() / name, installed_runtime_dir() / name

    @classmethod
    def get(cls, what: str, compute: Callable[[], str]) -> str:
        path, installed = cls._paths()
        with cls._lock:
            entries = cls._entries.get(path)
            if entries is None:
                # A new cache starts from what the installation recorded.
                entries = {**cls._read(installed), **cls._read(path)}
                cls._entries[path] = entries
            value = entries.get(what)
        if value is not None:
            return value
        value = compute()
        with cls._lock:
            entries[what] = value
            merged = {**cls._read(path), **entries}
            write_atomic(str(path), json.dumps(merged, sort_keys=True), make_dirs=True)
        return value

    @classmethod
    def install(cls) -> None:
        """Copies this environment's record from the cache into the
        installation, merged with what is there."""
        path, installed = cls._paths()
        with cls._lock:
            merged = {**cls._read(installed), **cls._read(path)}
            write_atomic(
                str(installed), json.dumps(merged, sort_keys=True), make_dirs=True
            )

    @staticmethod
    def _read(path: Path) -> dict[str, str]:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if isinstance(v, str)}


@functools.cache
def _runtime_sources_digest() -> str:
    return cache_key(
        *(
            (RUNTIME_DIR / name).read_text()
            for name in (*RUNTIME_HEADERS, RUNTIME_SOURCE.name)
        )
    )


# ---------------------------------------------------------------------------
# Once per cache: the runtime extension and the precompiled headers
# ---------------------------------------------------------------------------


class RuntimeExtension:
    """torch_cppwrap._C: the runtime's function table, built once per cache."""

    _module: ModuleType | None = None
    # The runtime sources the loaded module was built from.
    _digest: str | None = None
    _lock = threading.Lock()

    @classmethod
    def load(cls) -> ModuleType:
        if cls._module is not None:
            return cls._module
        with cls._lock:
            if cls._module is None:
                cls._module = cls._build_and_load()
        return cls._module

    @staticmethod
    def artefact(build: Build | None = None) -> tuple[str, Path]:
        """The key and the path of this cache's runtime extension."""
        build = build or toolchain().runtime_extension()
        key = cache_key(
            "runtime",
            _runtime_sources_digest(),
            build.fingerprint(),
            _compiler_version(),
            torch.__version__,
        )
        return key, cache_root() / "runtime" / key / "cppwrap_runtime.so"

    @classmethod
    def ensure_built(cls, *, install: bool = False) -> Path:
        """The path of the runtime extension, built if need be: the installed
        one where it matches, else this cache's (see `installed_or_cached`)."""
        build = toolchain().runtime_extension()
        key, cached = cls.artefact(build)

        def build_runtime(build_dir: Path, where: str) -> Path:
            shutil.copyfile(RUNTIME_SOURCE, build_dir / RUNTIME_SOURCE.name)
            with _first_use_step(
                f"building the runtime extension for torch {torch.__version__}",
                f"{where}, into {build_dir.parent}",
                build_dir,
            ):
                return build.run(build_dir, RUNTIME_SOURCE)

        return installed_or_cached(
            cached, key, "the runtime extension", build_runtime, install=install
        )

    @classmethod
    def check_matches(cls, runtime_digest: str) -> None:
        """Raises unless the loaded runtime was built from the runtime
        sources a graph module is compiled against (which changed on disk
        when the package was upgraded under a running process): the two
        share structures, and a mismatch would crash."""
        if cls._digest is not None and cls._digest != runtime_digest:
            raise RuntimeError(
                f"torch_cppwrap: the runtime sources in {RUNTIME_DIR} changed "
                "after this process loaded its runtime extension (was the "
                "package upgraded while it ran?); a new graph built against "
                "them would not match it. Restart the process."
            )

    @classmethod
    def _build_and_load(cls) -> ModuleType:
        cls._digest = _runtime_sources_digest()
        module = _load_extension("torch_cppwrap._C", cls.ensure_built())
        sys.modules["torch_cppwrap._C"] = module
        import torch_cppwrap

        torch_cppwrap._C = module  # type: ignore[attr-defined]
        return module


def precompiled_header_dir(
    header: Path, include_name: str, build: Build, digest: str, *, install: bool = False
) -> Path | None:
    """A directory holding `include_name`.gch: `header` precompiled by
    `build` (a precompiling build named after the header), once per cache.
    Listed first among the include directories of a translation unit built
    with the same options, it lets gcc skip parsing the header (gcc falls
    back to the header where the options differ).  None where headers are
    not precompiled: Inductor's ``cpp_cache_precompile_headers`` is off, or
    the compiler is not gcc."""
    if not (inductor_config.cpp_cache_precompile_headers and _is_gcc()):
        return None
    key = cache_key(
        "pch", digest, build.fingerprint(), _compiler_version(), torch.__version__
    )
    what = f"the precompiled {Path(include_name).name}"

    def build_header(build_dir: Path, where: str) -> Path:
        shutil.copyfile(header, build_dir / build.sources[0])
        with _first_use_step(f"building {what}", where, build_dir):
            return build.run(build_dir, header)

    cached = cache_root() / "pch" / key / f"{include_name}.gch"
    return installed_or_cached(cached, key, what, build_header, install=install).parent


def kernel_prefix_pch(tc: _Toolchain, *, install: bool = False) -> Path | None:
    """cpp_prefix.h, which heads every kernel translation unit."""
    header = Path(torch.__file__).resolve().parent / "include" / CPP_PREFIX_INCLUDE
    return precompiled_header_dir(
        header,
        CPP_PREFIX_INCLUDE,
        tc.kernel_compile(header.name, precompiling=True),
        cache_key(header.read_text()),
        install=install,
    )


def wrapper_runtime_pch(
    tc: _Toolchain, device_type: str, *, install: bool = False
) -> Path | None:
    """The device's wrapper header (`WRAPPER_HEADERS`: the runtime's, with
    Python.h and the C shim), which heads every wrapper translation unit:
    nearly all of its compile time."""
    header = WRAPPER_HEADERS[device_type]
    return precompiled_header_dir(
        RUNTIME_DIR / header,
        header,
        tc.wrapper_compile(device_type, header, precompiling=True),
        _runtime_sources_digest(),
        install=install,
    )


def _is_gcc() -> bool:
    def probe() -> str:
        try:
            return "yes" if cpp_builder.is_gcc() else "no"
        except Exception:  # pragma: no cover - compiler probing failed
            return "no"

    return _BuildMemo.get("compiler is gcc", probe) == "yes"


def prepare_runtime(device_type: str = "cpu", *, install: bool = False) -> None:
    """Builds what torch_cppwrap builds once per Inductor cache (the runtime
    extension and the precompiled headers), so that no graph's first compile
    pays for it; with `install`, into the installation instead."""
    tc = toolchain()
    with _alongside(functools.partial(RuntimeExtension.ensure_built, install=install)):
        wrapper_pch = wrapper_runtime_pch(tc, device_type, install=install)
        kernel_pch = (
            kernel_prefix_pch(tc, install=install) if device_type == "cpu" else None
        )
    if install:
        # What a graph's key hashes and the commands its build runs against
        # these headers, recorded with the installation: a compile in a new
        # cache then runs the compiler without working out cpp_builder's
        # options first.
        wrapper = tc.wrapper_compile(device_type, WRAPPER_SOURCE)
        compiles = [(wrapper, wrapper_pch)]
        if device_type == "cpu":
            compiles.append((tc.kernel_compile(KERNEL_SOURCE), kernel_pch))
        objects = [build.output for build, _ in compiles]
        # A graph without C++ kernels links its wrapper alone.
        links = [
            (tc.link(objects[:count]), None) for count in range(1, len(objects) + 1)
        ]
        if device_type == "cuda":
            # A CUDA graph's wrapper links with its launchers' units, as many
            # as there are compile threads at most.
            units: dict[str, Build] = {}
            for count in range(1, (inductor_config.compile_threads or 1) + 1):
                names = _launcher_unit_names(count)
                for name in names:
                    if name not in units:
                        units[name] = tc.wrapper_compile(
                            device_type, f"../{name}.cpp", name=name
                        )
                        compiles.append((units[name], wrapper_pch))
                outputs = [wrapper.output, *(units[name].output for name in names)]
                links.append((tc.link(outputs), None))
        for build, header in [*compiles, *links]:
            build.fingerprint()
            build.with_include_dir(header).command()
            _ = build.output
        _BuildMemo.install()


_prefetch_lock = threading.Lock()
_prefetched: set[tuple[Path, str]] = set()


def prefetch(device_type: str) -> None:
    """Starts building, in the background, what every module for
    `device_type` needs from this cache: the runtime extension and the
    wrapper's precompiled header (and for CPU, whose graphs have Inductor's
    C++ kernels, the kernels' precompiled header).  Called as Inductor starts
    generating a graph's code, so that in a new cache these builds overlap
    code generation instead of following it.  A failure is left for the load
    that needs the artefact to raise."""
    if device_type not in DEVICE_DEFINITIONS:
        return
    with _prefetch_lock:
        if (cache_root(), device_type) in _prefetched:
            return
        _prefetched.add((cache_root(), device_type))
    tc = toolchain()
    builds: list[tuple[Callable[..., object], tuple[Any, ...]]] = [
        (RuntimeExtension.load, ()),
        (wrapper_runtime_pch, (tc, device_type)),
    ]
    if device_type == "cpu":
        # Picked here, in the compiling thread, before a build thread reads
        # it: Inductor's first look at each vector ISA probes it, and a probe
        # adds -mavx512bf16 to the ISA's flags for a moment.  Two threads
        # probing at once can leave it there, and the kernels' flags, so the
        # precompiled cpp_prefix.h's key, would then change mid-compile.
        _ = tc.vec_isa
        builds.append((kernel_prefix_pch, (tc,)))
    for work, args in builds:
        # Daemon threads: a process that ends meanwhile does not wait for
        # them (the build directory left behind is removed by the next build).
        threading.Thread(
            target=contextvars.copy_context().run,
            args=(_quietly, work, *args),
            name="torch_cppwrap-prefetch",
            daemon=True,
        ).start()


def _quietly(work: Callable[..., object], *args: Any) -> None:
    try:
        work(*args)
    except Exception:
        log.debug("torch_cppwrap: prefetching failed", exc_info=True)


# ---------------------------------------------------------------------------
# Graph modules
# ---------------------------------------------------------------------------

# A graph builds in a directory inside its key directory, where its sources
# stay (for the compiler's messages and for reading).
WRAPPER_SOURCE = "../wrapper.cpp"
KERNEL_SOURCE = "../kernels.cpp"

# Launchers per translation unit, at the least.  A unit costs about 0.2 s
# however small (reading the precompiled header) and about 12 ms a launcher:
# units that run side by side take the wall time of one, so a graph's
# launchers split into units of this many or more, one per compile thread at
# most (see `launcher_units`); on the H200, the training step's three graphs
# compiled their launchers in 1.17 s instead of 1.92.
LAUNCHERS_PER_UNIT = 8


def launcher_units(launchers: Sequence[str], device_type: str) -> list[str]:
    """The translation units that compile a graph's kernel launchers (each
    launcher's definition, as CppWrapperGpu.define_launchers made it), side
    by side: after the kernels are tuned, they are all of the graph's build
    but its link.  Each unit begins with the device's wrapper header, whose
    precompiled form it reads."""
    if not launchers:
        return []
    threads = inductor_config.compile_threads or 1
    count = max(1, min(len(launchers) // LAUNCHERS_PER_UNIT, threads))
    size = -(-len(launchers) // count)
    head = f'#include "{WRAPPER_HEADERS[device_type]}"\n'
    return [
        head + "\n".join(launchers[start : start + size])
        for start in range(0, len(launchers), size)
    ]


def _launcher_unit_names(count: int) -> list[str]:
    return ["launchers"] if count == 1 else [f"launchers_{i}" for i in range(count)]


def wrapper_object(wrapper_source: str, device_type: str) -> Path:
    """The wrapper translation unit compiled on its own, once per cache: what
    `start_wrapper_build` builds while a CUDA graph's kernels are tuned."""
    tc = toolchain()
    build = tc.wrapper_compile(device_type, WRAPPER_SOURCE)
    key = cache_key(
        "wrapper object",
        wrapper_source,
        device_type,
        _runtime_sources_digest(),
        build.fingerprint(),
        _compiler_version(),
        torch.__version__,
    )
    directory = cache_root() / key[1:3] / key

    def compile_wrapper(build_dir: Path) -> Path:
        source = directory / Path(WRAPPER_SOURCE).name
        write_atomic(str(source), wrapper_source, encode_utf_8=True)
        header = wrapper_runtime_pch(tc, device_type)
        return build.with_include_dir(header).run(build_dir, source)

    what = f"the wrapper object {key[:12]}"
    return ensure_built(directory / build.output, key, what, compile_wrapper)


# Wrapper objects being built ahead of their graph's link, by (device type,
# wrapper source): started by the codegen, taken by GraphBuild.build.
_early_lock = threading.Lock()
_early_builds: dict[tuple[str, str], concurrent.futures.Future[Path]] = {}


def start_wrapper_build(wrapper_source: str, device_type: str) -> None:
    """Starts compiling `wrapper_source` in the background.  A CUDA graph's
    wrapper is final before its Triton kernels are tuned (only the launchers
    need the tuned configs), so it compiles while they do; the graph's build
    then compiles the launchers and links.  The build's error, if any, is
    raised by the load that takes it (`take_wrapper_build`)."""
    future: concurrent.futures.Future[Path] = concurrent.futures.Future()
    with _early_lock:
        if (
            _early_builds.setdefault(_early_key(wrapper_source, device_type), future)
            is not future
        ):
            return

    def build() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(wrapper_object(wrapper_source, device_type))
        except BaseException as error:
            future.set_exception(error)

    # A daemon thread, as a prefetch: a process that ends meanwhile does not
    # wait for the compiler.
    threading.Thread(
        target=contextvars.copy_context().run,
        args=(build,),
        name="torch_cppwrap-wrapper",
        daemon=True,
    ).start()


def take_wrapper_build(
    wrapper_source: str, device_type: str
) -> concurrent.futures.Future[Path] | None:
    """The early build of `wrapper_source`, if one was started, forgotten
    here (a codegen that fails after starting one takes it to drop it)."""
    with _early_lock:
        return _early_builds.pop(_early_key(wrapper_source, device_type), None)


def _early_key(wrapper_source: str, device_type: str) -> tuple[str, str]:
    # Blank lines at either end are how the source sits in the module's
    # Python literal, not part of what it compiles to.
    return device_type, wrapper_source.strip()


class GraphBuild:
    """The builds of one graph's module: the wrapper and kernel translation
    units, compiled side by side, then linked."""

    def __init__(
        self,
        wrapper_source: str,
        kernel_source: str,
        device_type: str,
        launchers: Sequence[str] = (),
    ) -> None:
        tc = toolchain()
        self.tc = tc
        self.device_type = device_type
        self.wrapper_source = wrapper_source
        self.kernel_source = kernel_source
        self.launcher_units = launcher_units(launchers, device_type)
        # The wrapper's object, where the codegen started building it early;
        # else `build` compiles it with the other units.
        self.early_wrapper = take_wrapper_build(wrapper_source, device_type)
        self.wrapper = tc.wrapper_compile(device_type, WRAPPER_SOURCE)
        self.kernels = (
            tc.kernel_compile(KERNEL_SOURCE) if kernel_source.strip() else None
        )
        self.launchers = [
            tc.wrapper_compile(device_type, f"../{name}.cpp", name=name)
            for name in _launcher_unit_names(len(self.launcher_units))
        ]
        builds = [self.wrapper, self.kernels, *self.launchers]
        self.link = tc.link([b.output for b in builds if b])
        builds.append(self.link)
        self.runtime_digest = _runtime_sources_digest()
        # Precompiled headers are left out: they change how fast a module
        # builds, not what it is.
        self.key = cache_key(
            "graph",
            wrapper_source,
            kernel_source,
            *self.launcher_units,
            device_type,
            self.runtime_digest,
            *(b.fingerprint() for b in builds if b),
            _compiler_version(),
            torch.__version__,
        )
        self.directory = cache_root() / self.key[1:3] / self.key
        self.module_path = self.directory / f"cppwrap_{self.key[:24]}.so"

    def build(self, build_dir: Path) -> Path:
        assert build_dir.parent == self.directory
        wrapper_path = self.directory / Path(WRAPPER_SOURCE).name
        write_atomic(str(wrapper_path), self.wrapper_source, encode_utf_8=True)

        def wrapper_header() -> Path | None:
            return wrapper_runtime_pch(self.tc, self.device_type)

        def kernel_header() -> Path | None:
            return kernel_prefix_pch(self.tc)

        early = self.early_wrapper
        units: list[tuple[Callable[[], Path | None], Build, Path]] = []
        if early is None:
            units.append((wrapper_header, self.wrapper, wrapper_path))
        sources = [
            (self.kernels, self.kernel_source, kernel_header),
            *(
                (build, text, wrapper_header)
                for build, text in zip(self.launchers, self.launcher_units, strict=True)
            ),
        ]
        for build, text, header in sources:
            if build is None:
                continue
            path = self.directory / Path(build.sources[0]).name
            write_atomic(str(path), text, encode_utf_8=True)
            units.append((header, build, path))

        def compile_unit(
            header: Callable[[], Path | None], build: Build, source: Path
        ) -> Path:
            return build.with_include_dir(header()).run(build_dir, source)

        # Each wait is timed (compile_times(), tlparse), so that a compile's
        # seconds in our build split into what the tuning block did not
        # hide of the early wrapper build, the units built now, the link.
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(len(units), 1), thread_name_prefix="torch_cppwrap"
        ) as pool:
            futures = [_submit(pool, compile_unit, *unit) for unit in units]
            if early is not None:
                # The wrapper's error first.
                with dynamo_timed("GraphBuild.wait_for_early_wrapper"):
                    shutil.copyfile(early.result(), build_dir / self.wrapper.output)
            with dynamo_timed("GraphBuild.compile_units"):
                for future in futures:
                    future.result()
        with dynamo_timed("GraphBuild.link"):
            return self.link.run(build_dir, wrapper_path)


@clear_on_fresh_cache
class CppWrapperCodeCache:
    """Compiles generated wrapper modules and loads them, memoised in-process
    and on disk."""

    cache: dict[str, ModuleType] = {}
    _lock = threading.Lock()

    @classmethod
    def cache_clear(cls) -> None:
        with cls._lock:
            cls.cache.clear()
        with _prefetch_lock:
            _prefetched.clear()

    @classmethod
    def load_pybinding(cls, *args: object, **kwargs: object) -> None:
        """The entry point of modules generated by upstream's C++ wrappers,
        which torch_cppwrap does not build."""
        raise NotImplementedError(
            "torch_cppwrap replaced Inductor's CppWrapperCodeCache and does not "
            "build modules generated by upstream's C++ wrapper (a device that "
            "torch_cppwrap does not cover, e.g. xpu or mps); call "
            "torch_cppwrap.unpatch() to compile for that device with cpp_wrapper=True"
        )

    @classmethod
    def load(
        cls,
        wrapper_source: str,
        kernel_source: str = "",
        *,
        device_type: str = "cpu",
        launchers: Sequence[str] = (),
        binds_constants: bool = False,
    ) -> ModuleType:
        """Returns the extension module built from the sources: the wrapper,
        Inductor's C++ kernels and the definitions of a CUDA graph's Triton
        kernel launchers (grouped into translation units here).

        A module that binds constants keeps them in its module state; where
        the same sources were loaded already (an FX graph cache hit: the same
        graph, frozen with other weights), the library is loaded again as
        another module, which binds its own."""
        if device_type not in DEVICE_DEFINITIONS:
            raise NotImplementedError(
                f"torch_cppwrap: no C++ wrapper build for {device_type!r}"
            )
        graph = GraphBuild(wrapper_source, kernel_source, device_type, launchers)
        with cls._lock:
            module = cls.cache.get(graph.key)
        if module is not None:
            if binds_constants:
                return _load_graph_module(graph)
            return module

        # Timed as Inductor times its own phases (compile_times(), tlparse):
        # the part of a compile that is ours to make fast.
        with dynamo_timed("CppWrapperCodeCache.load", log_pt2_compile_event=True):
            module = cls._build_and_load(graph)
        with cls._lock:
            cls.cache[graph.key] = module
        return module

    @staticmethod
    def _build_and_load(graph: GraphBuild) -> ModuleType:
        name = graph.module_path.stem
        if RuntimeExtension._module is not None:
            RuntimeExtension.check_matches(graph.runtime_digest)
            ensure_built(graph.module_path, graph.key, name, graph.build)
        else:
            # A graph module needs the runtime extension to load, not to
            # build: in a new cache, build the two side by side.
            with _alongside(RuntimeExtension.load):
                ensure_built(graph.module_path, graph.key, name, graph.build)
            RuntimeExtension.check_matches(graph.runtime_digest)
        return _load_graph_module(graph)
