"""Building and loading the C++ that torch_cppwrap generates.

Two kinds of artefact, two caches:

* The runtime extension (``runtime/cppwrap_runtime_ext.cpp``) and a
  precompiled ``cpp_prefix.h`` depend only on torch, the compiler and its
  flags.  They are built once per torch version into torch_cppwrap's own cache
  (``$TORCH_CPPWRAP_CACHE_DIR``, default ``~/.cache/torch_cppwrap``).
* Each graph's wrapper module lives in Inductor's cache directory, keyed by the
  SHA-256 of its sources, the full compile commands and the torch version.

Both go through :func:`_build_once`: a per-key file lock with a timeout, a
second look inside the lock, compilation into a private temporary directory
and an atomic rename, so concurrent processes never see a half-written file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from torch_cppwrap import _compat

log = logging.getLogger(__name__)

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
RUNTIME_HEADERS = (
    "cppwrap_api.h",
    "cppwrap_dtypes.h",
    "cppwrap_sizes.h",
    "cppwrap_runtime.h",
    "cppwrap_cuda.h",
)

# Extra (compile, link) flags of a wrapper module, by device: CUDA modules call
# the aoti_torch_cuda_* shim, which lives in libtorch_cuda.
DEVICE_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cpu": ((), ()),
    "cuda": (("-DUSE_CUDA",), ("-ltorch_cuda",)),
}
CPP_PREFIX_INCLUDE = "torch/csrc/inductor/cpp_prefix.h"

# How long to wait for another process that is building the same artefact.
LOCK_TIMEOUT_S = float(os.environ.get("TORCH_CPPWRAP_LOCK_TIMEOUT", 600))


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


def sha256_hex(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        # Length-prefix every part so ("ab", "c") and ("a", "bc") differ.
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


@contextlib.contextmanager
def _first_use_step(action: str, why: str) -> Iterator[None]:
    """Says on stderr what a once-per-torch-version (or per-machine) step
    does and how long it took: the first compile in a new environment pauses
    for a minute, and should say why.  Later runs find the result and say
    nothing."""
    print(f"torch_cppwrap: {action} ({why})...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        elapsed = time.perf_counter() - started
        print(f"torch_cppwrap: {action}: {outcome} {elapsed:.1f} s", file=sys.stderr)


def runtime_cache_dir() -> Path:
    root = os.environ.get("TORCH_CPPWRAP_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
        root = os.path.join(xdg, "torch_cppwrap")
    path = Path(root).resolve() / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------
# Inductor's vector-ISA probe, remembered per machine
# ---------------------------------------------------------------------------


@functools.cache
def _machine_identity() -> str:
    """What a vector-ISA probe's answer depends on besides the ISA: the CPU's
    feature flags, the compiler and the torch build."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return sha256_hex(torch.__version__, flags, compiler, version, sys.executable)


def remember_vec_isa_probe(
    check_build: Callable[[Any, str], bool],
) -> Callable[[Any, str], bool]:
    """Wraps Inductor's ``VecISA.check_build``, which compiles and loads a test
    library to learn whether the machine runs an ISA's code.  Inductor keeps
    the answer in its cache directory, so every process that starts with an
    empty one pays the probe again (seconds, and tens of seconds where
    importing torch is slow); the answer is a fact about the machine, so it is
    kept in torch_cppwrap's cache and asked once per machine."""

    @functools.wraps(check_build)
    def check_build_once(isa: Any, code: str) -> bool:
        arch_flags = getattr(isa, "build_arch_flags", lambda: "")()
        key = sha256_hex(_machine_identity(), str(isa), str(arch_flags), code)
        path = runtime_cache_dir() / "vec_isa" / f"{key[:32]}.txt"
        try:
            return path.read_text().strip() == "ok"
        except OSError:
            pass
        with _first_use_step(
            f"checking whether this CPU runs {isa} code", "once per machine"
        ):
            ok = check_build(isa, code)
        # A read-only cache only costs the probe next time.
        with contextlib.suppress(OSError):
            write_atomic(path, "ok\n" if ok else "no\n")
        return ok

    return check_build_once


def graph_cache_dir() -> Path:
    path = Path(_compat.inductor_cache_dir()) / "cppwrap"
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def _run(cmd: Sequence[str], source_path: str, cwd: str) -> None:
    proc = subprocess.run(
        list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    if proc.returncode != 0:
        raise CppWrapperCompileError(
            cmd, proc.stdout.decode(errors="replace"), source_path
        )


def _run_parallel(jobs: Sequence[tuple[Sequence[str], str]], cwd: str) -> None:
    """Runs compile commands side by side; raises for the first that failed."""
    procs = [
        (
            subprocess.Popen(
                list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            ),
            cmd,
            src,
        )
        for cmd, src in jobs
    ]
    failure: CppWrapperCompileError | None = None
    for proc, cmd, src in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0 and failure is None:
            failure = CppWrapperCompileError(cmd, out.decode(errors="replace"), src)
    if failure is not None:
        raise failure


def _build_once(target: Path, build: Callable[[Path], Path], what: str) -> Path:
    """Produces `target` with `build(tmpdir) -> built_file` unless it exists.

    The lock is an OS-level (fcntl) lock, so a process killed mid-build leaves
    nothing that blocks the next one.
    """
    if target.exists():
        return target
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            if target.exists():  # built by another process while we waited
                return target
            tmpdir = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
            try:
                started = time.perf_counter()
                built = build(tmpdir)
                os.replace(built, target)
                log.info(
                    "torch_cppwrap: built %s in %.1f s",
                    what,
                    time.perf_counter() - started,
                )
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)
    except Timeout:
        raise RuntimeError(
            f"torch_cppwrap: timed out after {LOCK_TIMEOUT_S:.0f} s waiting for "
            f"another process to build {what} ({target}); set "
            "TORCH_CPPWRAP_LOCK_TIMEOUT to wait longer"
        ) from None
    return target


def _load_extension(module_name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@dataclass
class BuildCommands:
    """The compile and link command lines for one wrapper module."""

    wrapper: list[str]
    kernels: list[str] | None
    link: list[str]
    pch: list[str] | None = None
    extra_inputs: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        return shlex.join([*self.wrapper, "|", *(self.kernels or []), "|", *self.link])


class _Toolchain:
    """Compile commands derived from Inductor's cpp_builder, computed once."""

    def __init__(self) -> None:
        from torch._inductor import cpp_builder

        self._cpp_builder = cpp_builder
        self.runtime_include = f"-I{RUNTIME_DIR}"

    @functools.cached_property
    def vec_isa(self) -> Any:
        # Probing the ISA compiles and runs test programs (seconds); only
        # graphs with C++ kernels need it.
        return _compat.pick_vec_isa()

    def _command(self, sources: list[str], output: str, **options: object) -> list[str]:
        build_option = _compat.build_options(device_type="cpu", **options)
        name, output_dir = (
            os.path.splitext(os.path.basename(output))[0],
            os.path.dirname(output),
        )
        builder = self._cpp_builder.CppBuilder(
            name=name, sources=sources, BuildOption=build_option, output_dir=output_dir
        )
        cmd = shlex.split(builder.get_command_line())
        # cpp_builder names the output after `name`; point it at `output`.
        if "-o" in cmd:
            cmd[cmd.index("-o") + 1] = output
        return cmd

    def wrapper_compile(
        self, source: str, obj: str, pch_dir: str | None = None
    ) -> list[str]:
        from torch._inductor.cpu_vec_isa import invalid_vec_isa

        cmd = self._command(
            [source], obj, vec_isa=invalid_vec_isa, compile_only=True, min_optimize=True
        )
        if pch_dir is not None:
            cmd.append(f"-I{pch_dir}")  # searched before the runtime directory
        return [*cmd, self.runtime_include]

    def kernel_compile(self, source: str, obj: str, pch_dir: str | None) -> list[str]:
        cmd = self._command([source], obj, vec_isa=self.vec_isa, compile_only=True)
        if pch_dir is not None:
            # A directory holding only the .gch is searched first; gcc then
            # uses the precompiled cpp_prefix.h if its flags match.
            cmd.insert(1, f"-I{pch_dir}")
        return cmd

    @staticmethod
    def pch_compile(compile_cmd: list[str], header: str, gch: str) -> list[str]:
        """The command that precompiles `header` with the flags of
        `compile_cmd`, a compile of the placeholder source "SRC" to "OUT"."""
        cmd = [gch if arg == "OUT" else arg for arg in compile_cmd if arg != "-c"]
        idx = cmd.index("SRC")
        cmd[idx : idx + 1] = ["-x", "c++-header", header]
        return cmd

    def link(self, objects: list[str], output: str) -> list[str]:
        from torch._inductor.cpu_vec_isa import invalid_vec_isa

        return self._command(
            [*objects, *self.shared_libstdcxx], output, vec_isa=invalid_vec_isa
        )

    def runtime_extension(self, source: str, output: str) -> list[str]:
        from torch._inductor.cpu_vec_isa import invalid_vec_isa

        cmd = self._command(
            [source, *self.shared_libstdcxx],
            output,
            vec_isa=invalid_vec_isa,
            include_pytorch=True,
        )
        return [*cmd, self.runtime_include]

    @functools.cached_property
    def shared_libstdcxx(self) -> list[str]:
        """The C++ runtime libtorch uses, linked by path.  Our modules pass
        exceptions and strings to and from libtorch, so they must share its
        libstdc++; some toolchains (the GPU machine's g++) link a static copy
        by default, whose iostreams and exception_ptr crash or misbehave
        beside libtorch's."""
        return loaded_library("libstdc++.so")


_toolchain_lock = threading.Lock()
_toolchain: _Toolchain | None = None


def toolchain() -> _Toolchain:
    global _toolchain
    with _toolchain_lock:
        if _toolchain is None:
            _toolchain = _Toolchain()
        return _toolchain


def _runtime_sources_digest() -> str:
    return sha256_hex(
        *(
            (RUNTIME_DIR / name).read_bytes()
            for name in (*RUNTIME_HEADERS, "cppwrap_runtime_ext.cpp")
        )
    )


class RuntimeExtension:
    """torch_cppwrap._C: the runtime's function table, built once per torch."""

    _module: ModuleType | None = None
    _lock = threading.Lock()

    @classmethod
    def load(cls) -> ModuleType:
        if cls._module is not None:
            return cls._module
        with cls._lock:
            if cls._module is None:
                cls._module = cls._build_and_load()
        return cls._module

    @classmethod
    def _build_and_load(cls) -> ModuleType:
        source = RUNTIME_DIR / "cppwrap_runtime_ext.cpp"
        tc = toolchain()
        probe = tc.runtime_extension(str(source), "runtime.so")
        key = sha256_hex(
            _runtime_sources_digest(), shlex.join(probe), torch.__version__
        )
        target = runtime_cache_dir() / "runtime" / f"cppwrap_runtime_{key[:20]}.so"

        def build(tmpdir: Path) -> Path:
            out = tmpdir / "runtime.so"
            with _first_use_step(
                f"building the runtime extension for torch {torch.__version__}",
                f"once per torch version, into {target.parent}",
            ):
                _run(
                    tc.runtime_extension(str(source), str(out)),
                    str(source),
                    str(tmpdir),
                )
            return out

        path = _build_once(target, build, "the runtime extension")
        module = _load_extension("torch_cppwrap._C", path)
        sys.modules["torch_cppwrap._C"] = module
        import torch_cppwrap

        torch_cppwrap._C = module  # type: ignore[attr-defined]
        return module


_pch_lock = threading.Lock()
_pch_dirs: dict[str, str | None] = {}


def precompiled_header_dir(
    header: Path, include_name: str, compile_cmd: list[str], digest: str
) -> str | None:
    """A directory holding `include_name`.gch, `header` precompiled with the
    flags of `compile_cmd` (a compile of "SRC" to "OUT"); built once per torch
    version and flag set into torch_cppwrap's own cache.  Listed with -I
    before the header's real directory, it lets gcc skip parsing the header
    when the flags match (and fall back to the header when they don't)."""
    if os.environ.get("TORCH_CPPWRAP_NO_PCH") == "1" or not _is_gcc():
        return None
    key = sha256_hex(digest, shlex.join(compile_cmd), torch.__version__)
    with _pch_lock:
        if key in _pch_dirs:
            return _pch_dirs[key]
        pch_root = runtime_cache_dir() / "pch" / key[:20]
        target = pch_root / (include_name + ".gch")
        what = f"the precompiled {Path(include_name).name}"

        def build(tmpdir: Path) -> Path:
            out = tmpdir / "header.gch"
            cmd = _Toolchain.pch_compile(compile_cmd, str(header), str(out))
            with _first_use_step(f"building {what}", "once per torch version"):
                _run(cmd, str(header), str(tmpdir))
            return out

        _build_once(target, build, what)
        _pch_dirs[key] = str(pch_root)
        return str(pch_root)


def kernel_prefix_pch(tc: _Toolchain) -> str | None:
    """cpp_prefix.h, which heads every kernel translation unit."""
    header = Path(torch.__file__).resolve().parent / "include" / CPP_PREFIX_INCLUDE
    return precompiled_header_dir(
        header,
        CPP_PREFIX_INCLUDE,
        tc.kernel_compile("SRC", "OUT", None),
        sha256_hex(header.read_bytes()),
    )


def wrapper_runtime_pch(tc: _Toolchain, device_type: str) -> str | None:
    """cppwrap_runtime.h (with Python.h and the C shim), which heads every
    wrapper translation unit: nearly all of its compile time."""
    compile_flags, _ = DEVICE_FLAGS[device_type]
    return precompiled_header_dir(
        RUNTIME_DIR / "cppwrap_runtime.h",
        "cppwrap_runtime.h",
        [*tc.wrapper_compile("SRC", "OUT"), *compile_flags],
        _runtime_sources_digest(),
    )


def _is_gcc() -> bool:
    from torch._inductor import cpp_builder

    try:
        return bool(cpp_builder.is_gcc())
    except Exception:  # pragma: no cover - compiler probing failed
        return False


def prepare_runtime(device_type: str = "cpu") -> None:
    """Builds everything torch_cppwrap builds once per torch version (the
    runtime extension and the precompiled headers), so that no graph's first
    compile pays for it."""
    RuntimeExtension.load()
    tc = toolchain()
    wrapper_runtime_pch(tc, device_type)
    if device_type == "cpu":
        kernel_prefix_pch(tc)


class CppWrapperCodeCache:
    """Compiles generated wrapper modules and loads them, memoised in-process
    and on disk."""

    cache: dict[str, ModuleType] = {}
    _lock = threading.Lock()

    @classmethod
    def cache_clear(cls) -> None:
        cls.cache.clear()

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
    ) -> ModuleType:
        """Returns the extension module built from the two sources."""
        if device_type not in DEVICE_FLAGS:
            raise NotImplementedError(
                f"torch_cppwrap: no C++ wrapper build for {device_type!r}"
            )
        RuntimeExtension.load()
        tc = toolchain()
        use_kernels = bool(kernel_source.strip())
        pch_dirs = (
            wrapper_runtime_pch(tc, device_type),
            kernel_prefix_pch(tc) if use_kernels else None,
        )

        # The commands use placeholder paths for the hash; the real ones differ
        # only in the directory.
        probe = cls._commands(tc, Path("DIR"), use_kernels, pch_dirs, device_type)
        key = sha256_hex(
            wrapper_source,
            kernel_source,
            probe.fingerprint(),
            torch.__version__,
            _runtime_sources_digest(),
            device_type,
        )
        with cls._lock:
            module = cls.cache.get(key)
        if module is not None:
            return module

        module_name = f"cppwrap_{key[:24]}"
        key_dir = graph_cache_dir() / key[:2] / key
        target = key_dir / f"{module_name}.so"

        def build(tmpdir: Path) -> Path:
            wrapper_path = key_dir / "wrapper.cpp"
            kernel_path = key_dir / "kernels.cpp"
            write_atomic(wrapper_path, wrapper_source)
            if use_kernels:
                write_atomic(kernel_path, kernel_source)
            cmds = cls._commands(tc, tmpdir, use_kernels, pch_dirs, device_type)
            jobs: list[tuple[Sequence[str], str]] = [
                (_with_source(cmds.wrapper, wrapper_path), str(wrapper_path))
            ]
            if cmds.kernels is not None:
                jobs.append((_with_source(cmds.kernels, kernel_path), str(kernel_path)))
            _run_parallel(jobs, str(tmpdir))
            _run(cmds.link, str(wrapper_path), str(tmpdir))
            return tmpdir / "module.so"

        _build_once(target, build, f"wrapper module {module_name}")
        # Every wrapper module's initialiser is PyInit_cppwrap_graph (a fixed
        # name keeps the precompiled header valid); the path tells them apart.
        module = _load_extension("cppwrap_graph", target)
        module.__cppwrap_source_dir__ = str(key_dir)  # type: ignore[attr-defined]
        with cls._lock:
            cls.cache[key] = module
        return module

    @staticmethod
    def _commands(
        tc: _Toolchain,
        tmpdir: Path,
        use_kernels: bool,
        pch_dirs: tuple[str | None, str | None] = (None, None),
        device_type: str = "cpu",
    ) -> BuildCommands:
        """Compile and link commands; `pch_dirs` holds the precompiled-header
        directories of the wrapper and the kernel translation units."""
        wrapper_obj = str(tmpdir / "wrapper.o")
        kernel_obj = str(tmpdir / "kernels.o")
        objects = [wrapper_obj, kernel_obj] if use_kernels else [wrapper_obj]
        compile_flags, link_flags = DEVICE_FLAGS[device_type]
        return BuildCommands(
            wrapper=[
                *tc.wrapper_compile("wrapper.cpp", wrapper_obj, pch_dirs[0]),
                *compile_flags,
            ],
            kernels=tc.kernel_compile("kernels.cpp", kernel_obj, pch_dirs[1])
            if use_kernels
            else None,
            link=[*tc.link(objects, str(tmpdir / "module.so")), *link_flags],
        )


def _with_source(cmd: list[str], source: Path) -> list[str]:
    return [
        str(source)
        if arg.endswith(("wrapper.cpp", "kernels.cpp")) and not arg.startswith("-")
        else arg
        for arg in cmd
    ]


def write_atomic(path: Path, content: str | bytes) -> None:
    """Writes `path` through a temporary file and a rename, so readers see
    the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    os.replace(tmp, path)
