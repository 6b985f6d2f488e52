"""torch_cppwrap as a patch series against torch's own ``torch/_inductor``.

This tool is not part of the package and never imports it (the import patches
torch): it reads the package's files.

``python tools/patches.py export`` writes ``patches/torch-<X.Y>/``: a
few ``git format-patch`` files and a quilt-style ``series`` that turn the
installed torch's Python sources into torch_cppwrap's, the way an upstream
pull request would.  ``check`` fails when the committed series is stale
(differs from what ``export`` produces now) or does not apply cleanly.

Where our files go (the layout of ``torch_cppwrap/_inductor/`` mirrors
upstream's ``torch/_inductor/``, so most files keep their relative path):

* ``_inductor/codegen/*.py`` -> ``torch/_inductor/codegen/``.  Our
  ``cpp_wrapper_cpu.py`` and ``cpp_wrapper_gpu.py`` replace upstream's, whose
  C-shim wrappers (what AOTInductor packages, and the base of the MPS, XPU and
  MTIA wrappers) move to ``cpp_wrapper_cpu_aoti.py`` and
  ``cpp_wrapper_gpu_aoti.py`` (see ``JIT_WRAPPERS``).
* ``_inductor/runtime/*.h|.cpp`` -> ``torch/_inductor/runtime/``, the
  package that already holds what generated code needs at run time; the
  runtime extension becomes ``torch._inductor.runtime._C``.
* ``_inductor/codecache.py`` -> ``torch/_inductor/cppwrap_codecache.py``, a new
  module: upstream's ``codecache.py`` keeps its own ``CppWrapperCodeCache``,
  which the C-shim wrappers still load their JIT modules through, so
  replacing or shadowing it would break MPS and XPU; the new module leaves
  ``codecache.py`` untouched (zero lines of diff there).
* ``_compat.py`` -> ``torch/_inductor/cppwrap_compat.py``.

Registration is done the upstream way: ``init_backend_registration`` registers
our wrappers for cpu and cuda, and ``get_wrapper_codegen_for_device`` takes the
graph's ``aot_mode`` so that AOTInductor keeps the C-shim wrappers it packages
into a model .so (what ``_patching.py``'s selectors do at run time); the
``try_get_kernel_name`` check in ``ir.py`` accepts both kinds.  The FX-graph
cache needs no tag pass there: ``codecache.torch_key()`` already hashes
torch's Python sources, ours included, and torch's version (the runtime
headers could join its ``extra_files`` for development builds).

The edits to upstream files are anchored on what they change and fail with a
clear message when an anchor is missing, so a new torch release either
exports cleanly or says which edit needs attention.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

_Node = TypeVar("_Node", bound=ast.AST)

# Our package's name as it appears in sources, and the dotted names it is
# rewritten to; module names derived from the file layout are added to this.
PACKAGE = "torch_cppwrap"
REPO = Path(__file__).resolve().parent.parent
PACKAGE_ROOT = REPO / PACKAGE
DEFAULT_PATCHES_DIR = REPO / "patches"
SERIES_FILE = "series"
EXTRA_MODULE_NAMES = {
    # The runtime extension sits beside the sources it is built from.
    f"{PACKAGE}._C": "torch._inductor.runtime._C",
    # What registers our wrappers (prose such as "torch_cppwrap.patch()
    # registers it for cuda"): upstream, the device registry does.
    f"{PACKAGE}.patch": "torch._inductor.codegen.common.init_backend_registration",
}
# Our files whose upstream path differs from their path in the package.
SPECIAL_TARGETS = {
    "_compat.py": "torch/_inductor/cppwrap_compat.py",
    "config.py": "torch/_inductor/cppwrap_config.py",
    "_inductor/codecache.py": "torch/_inductor/cppwrap_codecache.py",
    # Upstream, this would be a few lines of graph.py's _compile_to_module.
    "_inductor/graph.py": "torch/_inductor/cppwrap_fallback.py",
}
EXPORTED_SUFFIXES = (".py", ".h", ".cpp")
# Files of the package that the series leaves out for now, and why
# ("_inductor/x.py": "reason").
DEFERRED: dict[str, str] = {}


@dataclass(frozen=True)
class JitWrapper:
    """One of our C++ wrappers that replaces an upstream module of the same
    name: upstream's class moves to `<module>_aoti.py` for AOTInductor (and
    for the devices we do not serve), ours is registered for `devices`."""

    module: str  # in torch/_inductor/codegen/
    cls: str
    devices: tuple[str, ...]

    @property
    def path(self) -> str:
        return f"torch/_inductor/codegen/{self.module}.py"

    @property
    def aoti_module(self) -> str:
        return f"{self.module}_aoti"

    @property
    def aoti_cls(self) -> str:
        return f"Aoti{self.cls}"

    @property
    def jit_cls(self) -> str:
        return f"Jit{self.cls}"


JIT_WRAPPERS = (
    JitWrapper("cpp_wrapper_cpu", "CppWrapperCpu", ("cpu",)),
    JitWrapper("cpp_wrapper_gpu", "CppWrapperGpu", ("cuda",)),
)
# Upstream modules that ours replace -> where upstream's moves.
MOVED_UPSTREAM = {
    w.path: f"torch/_inductor/codegen/{w.aoti_module}.py" for w in JIT_WRAPPERS
}
COMMON = "torch/_inductor/codegen/common.py"
GRAPH = "torch/_inductor/graph.py"
IR = "torch/_inductor/ir.py"

AUTHOR = ("torch_cppwrap developers", "dev@torch-cppwrap.local")
# Fixed, so that export is reproducible and `check` can compare bytes.
COMMIT_DATE = "2026-01-01T00:00:00+0000"


class PatchError(RuntimeError):
    """The series cannot be produced from these sources (an anchor moved, an
    unmapped reference to torch_cppwrap, ...)."""


# ---------------------------------------------------------------------------
# the torch tree being patched
# ---------------------------------------------------------------------------


def installed_site_packages() -> Path:
    """The directory that holds the installed `torch/` package."""
    import torch

    return Path(torch.__file__).resolve().parent.parent


def torch_version_of(site_packages: Path) -> str:
    """torch.__version__ of the sources under `site_packages`, read without
    importing them."""
    text = (site_packages / "torch" / "version.py").read_text()
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if match is None:
        raise PatchError(f"no __version__ in {site_packages / 'torch' / 'version.py'}")
    return match.group(1)


def series_dir_name(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise PatchError(f"not a torch version: {version!r}")
    return f"torch-{match.group(1)}.{match.group(2)}"


class Tree:
    """Upstream's files under `root`, with our edits layered on top in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.edits: dict[str, str | None] = {}  # path -> text, None if removed

    def exists(self, path: str) -> bool:
        if path in self.edits:
            return self.edits[path] is not None
        return (self.root / path).is_file()

    def read(self, path: str) -> str:
        if path in self.edits:
            text = self.edits[path]
            if text is None:
                raise PatchError(f"{path} was removed by an earlier step")
            return text
        try:
            return (self.root / path).read_bytes().decode()
        except FileNotFoundError:
            raise PatchError(f"upstream has no {path} under {self.root}") from None

    def upstream(self, path: str) -> str | None:
        file = self.root / path
        return file.read_bytes().decode() if file.is_file() else None

    def write(self, path: str, text: str) -> None:
        self.edits[path] = text

    def remove(self, path: str) -> None:
        self.edits[path] = None

    def python_files(self) -> list[str]:
        """Every upstream .py file under torch/, with our edits applied."""
        found = {
            str(p.relative_to(self.root))
            for p in (self.root / "torch").rglob("*.py")
            if "__pycache__" not in p.parts
        }
        found |= {
            p for p, t in self.edits.items() if t is not None and p.endswith(".py")
        }
        return sorted(p for p in found if self.exists(p))


# ---------------------------------------------------------------------------
# our files, placed at upstream's paths
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    source: Path  # in torch_cppwrap/
    target: str  # relative to site-packages

    @property
    def module(self) -> str | None:
        return _dotted(str(self.source.relative_to(PACKAGE_ROOT.parent)))

    @property
    def target_module(self) -> str | None:
        return _dotted(self.target)


def _dotted(path: str) -> str | None:
    if not path.endswith(".py"):
        return None
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def placements(tree: Tree) -> list[Placement]:
    """Where each exported file of the package goes in torch."""
    sources = [PACKAGE_ROOT / name for name in SPECIAL_TARGETS]
    sources += sorted(
        p
        for p in (PACKAGE_ROOT / "_inductor").rglob("*")
        if p.is_file()
        and p.suffix in EXPORTED_SUFFIXES
        and "__pycache__" not in p.parts
    )
    result = []
    for source in sources:
        rel = str(source.relative_to(PACKAGE_ROOT))
        if rel in DEFERRED:
            continue
        target = SPECIAL_TARGETS.get(rel) or "torch/" + rel
        if source.name == "__init__.py" and tree.exists(target):
            if source.read_text().strip():
                raise PatchError(
                    f"{source} is not empty, but upstream already has {target}; "
                    "move its contents into a module"
                )
            continue  # upstream's package already exists
        if tree.exists(target) and target not in MOVED_UPSTREAM:
            raise PatchError(
                f"{source} would overwrite upstream's {target}; add a rule for it "
                "to SPECIAL_TARGETS or MOVED_UPSTREAM in tools/patches.py"
            )
        result.append(Placement(source, target))
    return result


def module_names(placed: Sequence[Placement]) -> dict[str, str]:
    """Our dotted module names -> theirs in torch, packages included."""
    names = dict(EXTRA_MODULE_NAMES)
    for item in placed:
        ours, theirs = item.module, item.target_module
        if ours is None or theirs is None:
            continue
        names[ours] = theirs
        rel = str(item.source.relative_to(PACKAGE_ROOT))
        if rel in SPECIAL_TARGETS:
            continue
        # torch_cppwrap/_inductor/codegen/x.py went to torch/_inductor/codegen/,
        # so torch_cppwrap._inductor.codegen is torch._inductor.codegen.
        package = ours.split(".")[1:-1]
        for end in range(1, len(package) + 1):
            names[".".join([PACKAGE, *package[:end]])] = ".".join(
                ["torch", *package[:end]]
            )
    return names


_DOTTED_REFERENCE = re.compile(rf"\b{PACKAGE}((?:\.[A-Za-z_]\w*)+)")
_FROM_IMPORT = re.compile(
    rf"^(?P<indent>[ \t]*)from (?P<module>{PACKAGE}[\w.]*) import (?P<names>.*)$"
)
_PLAIN_IMPORT = re.compile(rf"^(?P<indent>[ \t]*)import {PACKAGE}[ \t]*$")


def _map_name(dotted: str, names: dict[str, str], where: str) -> str:
    """torch_cppwrap.a.b.C -> the longest mapped prefix, rewritten.

    The package's public API (``torch_cppwrap.unpatch()``, no leading
    underscore) has no upstream counterpart and only appears in prose and
    messages, so it stays as it is; an unmapped private module is an error,
    since code that imports it would break upstream."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        prefix = ".".join(parts[:end])
        if prefix in names:
            return ".".join([names[prefix], *parts[end:]])
    if not parts[1].startswith("_"):
        return dotted
    raise PatchError(
        f"{where}: no upstream place for {dotted}; add it to EXTRA_MODULE_NAMES "
        "in tools/patches.py or stop referring to it"
    )


def _rewrite_from_import(
    match: re.Match[str], names: dict[str, str], where: str
) -> str:
    """`from torch_cppwrap.x import a, b as c`: each name is mapped on its own,
    because `a` may be a module that moves (torch_cppwrap._compat)."""
    indent, module, spec = match["indent"], match["module"], match["names"]
    comment = ""
    if "#" in spec:
        spec, comment = spec.split("#", 1)
        comment = "  #" + comment
    if "(" in spec or "\\" in spec:
        raise PatchError(
            f"{where}: multi-line import from {module}; keep it on one line"
        )
    groups: dict[str, list[str]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, alias = (p.strip() for p in item.partition(" as "))
        target = _map_name(f"{module}.{name}", names, where)
        parent, _, leaf = target.rpartition(".")
        local = alias or name
        groups.setdefault(parent, []).append(
            leaf if leaf == local else f"{leaf} as {local}"
        )
    lines = [
        f"{indent}from {parent} import {', '.join(items)}"
        for parent, items in groups.items()
    ]
    return "\n".join(lines) + comment


def rewrite_references(text: str, names: dict[str, str], where: str) -> str:
    """Our module names -> upstream's, in Python and C++ alike (imports, the
    generated code's import line, the extension's module and capsule names).
    Prose that merely says "torch_cppwrap" is left as it is."""
    lines = text.split("\n")
    attribute_targets = {
        _map_name(PACKAGE + ref.group(1), names, where)
        for line in lines
        if not _FROM_IMPORT.match(line)
        for ref in _DOTTED_REFERENCE.finditer(line)
    }
    for index, line in enumerate(lines):
        if match := _FROM_IMPORT.match(line):
            lines[index] = _rewrite_from_import(match, names, where)
        elif match := _PLAIN_IMPORT.match(line):
            # `import torch_cppwrap` exists for `torch_cppwrap.<attr>`: import
            # the modules that those attributes now live in.
            # Inside a function, `import torch.x` would make `torch` local to
            # it, so there the import binds only a private name.
            parents = sorted(
                {
                    t.rpartition(".")[0]
                    for t in attribute_targets
                    if not t.startswith(f"{PACKAGE}.")
                }
            )
            if not parents:
                raise PatchError(f"{where}:{index + 1}: `import {PACKAGE}` with no use")
            indent = match["indent"]
            lines[index] = "\n".join(
                f"{indent}import {p}"
                if not indent
                else f"{indent}import {p} as _{p.rpartition('.')[2]}  # noqa: F401"
                for p in parents
            )
    text = "\n".join(lines)
    text = _DOTTED_REFERENCE.sub(
        lambda m: _map_name(PACKAGE + m.group(1), names, where), text
    )
    leftover = re.search(rf"^\s*(from|import) {PACKAGE}\b.*$", text, re.M)
    if leftover:
        raise PatchError(f"{where}: import left unmapped: {leftover.group(0).strip()}")
    return text


def place_our_files(
    tree: Tree, placed: Sequence[Placement], keep: Callable[[str], bool]
) -> None:
    """Writes the placed files whose target `keep` accepts, their references
    to any of our modules rewritten."""
    names = module_names(placed)
    for item in (p for p in placed if keep(p.target)):
        where = str(item.source.relative_to(PACKAGE_ROOT.parent))
        text = item.source.read_bytes().decode()
        tree.write(item.target, rewrite_references(text, names, where))


# ---------------------------------------------------------------------------
# edits to upstream's own files
# ---------------------------------------------------------------------------


def _resolve(path: str, module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import` in `path`."""
    if level == 0:
        return module or ""
    package = path.split("/")[:-1]  # a module's package, or an __init__'s own
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _only(items: list[_Node], what: str) -> _Node:
    if len(items) != 1:
        raise PatchError(f"expected exactly one {what}, found {len(items)}")
    return items[0]


def _function(module: ast.Module, name: str, path: str) -> ast.FunctionDef:
    found = [
        node
        for node in ast.walk(module)
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    return _only(found, f"function {name} in {path}")


def move_upstream_wrappers(tree: Tree, ours: set[str]) -> None:
    """Moves each upstream module that one of ours replaces, unchanged, and
    points every upstream module that imports it (or names it in prose) at
    the new name.  `ours`: the paths our files take, which are left alone."""
    moves: dict[str, str] = {}
    for old, new in MOVED_UPSTREAM.items():
        if old not in ours:
            continue
        tree.write(new, tree.read(old))
        tree.remove(old)
        old_module, new_module = _dotted(old), _dotted(new)
        assert old_module is not None and new_module is not None
        moves[old_module] = new_module
    for path in tree.python_files():
        if path in ours:
            continue
        text = original = tree.read(path)
        for old_module, new_module in moves.items():
            text = _redirect_imports(path, text, old_module, new_module)
        if text != original:
            tree.write(path, text)


def _redirect_imports(path: str, text: str, old_module: str, new_module: str) -> str:
    old_leaf, new_leaf = old_module.rpartition(".")[2], new_module.rpartition(".")[2]
    if old_leaf not in text:
        return text
    lines = text.split("\n")
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(path, node.module, node.level)
            if old_module in {f"{target}.{a.name}" for a in node.names}:
                raise PatchError(
                    f"{path}:{node.lineno}: imports the {old_leaf} module by name; "
                    "teach _redirect_imports that form"
                )
            if target != old_module:
                continue
            spelled = "." * node.level + (node.module or "")
            new_spelled = spelled[: -len(old_leaf)] + new_leaf
            lines[node.lineno - 1] = lines[node.lineno - 1].replace(
                f"from {spelled} import", f"from {new_spelled} import", 1
            )
        elif isinstance(node, ast.Import) and any(
            a.name == old_module for a in node.names
        ):
            raise PatchError(f"{path}:{node.lineno}: `import {old_module}`; handle it")
    # Prose that sends readers to the moved file follows it.
    return re.sub(rf"\b{old_leaf}\.py\b", f"{new_leaf}.py", "\n".join(lines))


def _mode_helper(wrappers: Sequence[JitWrapper]) -> list[str]:
    """get_wrapper_codegen_for_device's new helper, as lines of common.py."""
    imports, pairs = [], []
    for w in wrappers:
        imports.append(f"        from .{w.module} import {w.cls}")
        imports.append(f"        from .{w.aoti_module} import {w.cls} as {w.aoti_cls}")
        pairs.append(f"            {w.cls}: {w.aoti_cls},")
    return [
        "def _cpp_wrapper_codegen_for_mode(",
        "    registered: WrapperConstructor | None, aot_mode: bool",
        ") -> WrapperConstructor | None:",
        '    """JIT graphs get the C++ wrappers that build a Python extension module',
        "    per graph; AOTInductor keeps the C-shim wrappers (*_aoti.py), which it",
        "    packages into a model .so around the AOTI runtime.  A class registered",
        '    by anyone else serves both."""',
        "    if aot_mode:",
        *imports,
        "",
        "        aot_wrappers: dict[WrapperConstructor | None, WrapperConstructor] = {",
        *pairs,
        "        }",
        "        return aot_wrappers.get(registered, registered)",
        "    return registered",
        "",
        "",
    ]


def register_jit_wrapper(tree: Tree) -> None:
    """Registers our CppWrapperCpu for cpu graphs, keeps upstream's for
    AOTInductor, and lets ExternKernel name C-shim kernels for both."""
    _register_in_common(tree)
    _pass_aot_mode_from_graph(tree)
    _accept_both_wrappers_in_ir(tree)


def _register_in_common(tree: Tree) -> None:
    text = tree.read(COMMON)
    module = ast.parse(text, COMMON)
    lines = text.split("\n")

    init = _function(module, "init_backend_registration", COMMON)
    for wrapper in JIT_WRAPPERS:
        _register_in_init(init, lines, wrapper)

    # get_wrapper_codegen_for_device learns the graph's mode.
    getter = _function(module, "get_wrapper_codegen_for_device", COMMON)
    params = [a.arg for a in getter.args.args]
    if params != ["device", "cpp_wrapper", "fx_wrapper"]:
        raise PatchError(
            f"{COMMON}: get_wrapper_codegen_for_device{tuple(params)} changed"
        )
    body_start = getter.body[0].lineno - 1
    header = "\n".join(lines[getter.lineno - 1 : body_start])
    new_header = re.sub(
        r"\(\s*device: str, cpp_wrapper: bool = False, fx_wrapper: bool = False,?\s*\)",
        "(\n    device: str,\n    cpp_wrapper: bool = False,\n"
        "    fx_wrapper: bool = False,\n    aot_mode: bool = False,\n)",
        header,
    )
    if new_header == header:
        raise PatchError(f"{COMMON}: get_wrapper_codegen_for_device's signature moved")
    reads = [
        i
        for i in range(body_start, getter.end_lineno or body_start)
        if lines[i].rstrip().endswith("wrapper_codegen_obj.cpp_wrapper_codegen")
    ]
    if len(reads) != 1:
        raise PatchError(
            f"{COMMON}: expected one read of wrapper_codegen_obj.cpp_wrapper_codegen "
            f"in get_wrapper_codegen_for_device, found {len(reads)}"
        )
    read = reads[0]
    indent_match = re.match(
        r"(\s*)(.*)wrapper_codegen_obj\.cpp_wrapper_codegen\s*$", lines[read]
    )
    assert indent_match is not None
    indent, lead = indent_match.groups()
    lines[read] = (
        f"{indent}{lead}_cpp_wrapper_codegen_for_mode(\n"
        f"{indent}    wrapper_codegen_obj.cpp_wrapper_codegen, aot_mode\n"
        f"{indent})"
    )
    lines[getter.lineno - 1 : body_start] = [new_header]
    first = getter.lineno - 1 - len(getter.decorator_list)
    lines[first:first] = _mode_helper(JIT_WRAPPERS)
    tree.write(COMMON, "\n".join(lines))


def _register_in_init(
    init: ast.FunctionDef, lines: list[str], wrapper: JitWrapper
) -> None:
    """Makes init_backend_registration register our class for wrapper.devices.

    After the move, it imports upstream's class from `<module>_aoti`.  If only
    our devices use it, that import now names our module; otherwise ours is
    imported as Jit<Class> and put in our devices' registrations only."""
    imports = [
        node
        for node in ast.walk(init)
        if isinstance(node, ast.ImportFrom)
        and node.module == wrapper.aoti_module
        and [a.name for a in node.names] == [wrapper.cls]
    ]
    node = _only(
        imports, f"import of {wrapper.cls} in {COMMON}:init_backend_registration"
    )
    uses: dict[str, list[ast.Name]] = {}
    for call in ast.walk(init):
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "register_backend_for_device"
            and call.args
            and isinstance(call.args[0], ast.Constant)
        ):
            continue
        names = [
            n for n in ast.walk(call) if isinstance(n, ast.Name) and n.id == wrapper.cls
        ]
        uses.setdefault(str(call.args[0].value), []).extend(names)
    if not all(uses.get(d) for d in wrapper.devices):
        raise PatchError(
            f"{COMMON}: init_backend_registration does not register {wrapper.cls} "
            f"for {', '.join(wrapper.devices)}"
        )
    line = lines[node.lineno - 1]
    if all(d in wrapper.devices for d, names in uses.items() if names):
        lines[node.lineno - 1] = line.replace(
            f"from .{wrapper.aoti_module} import", f"from .{wrapper.module} import", 1
        )
        return
    for device in wrapper.devices:
        for name in uses[device]:
            assert name.end_col_offset is not None
            row = lines[name.lineno - 1]
            lines[name.lineno - 1] = (
                row[: name.col_offset] + wrapper.jit_cls + row[name.end_col_offset :]
            )
    indent = line[: len(line) - len(line.lstrip())]
    lines[node.lineno - 1] = (
        f"{indent}from .{wrapper.module} import {wrapper.cls} as {wrapper.jit_cls}\n"
        + line
    )


def _pass_aot_mode_from_graph(tree: Tree) -> None:
    text = tree.read(GRAPH)
    lines = text.split("\n")
    calls = [
        node
        for node in ast.walk(ast.parse(text, GRAPH))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "get_wrapper_codegen_for_device"
    ]
    call = _only(calls, f"call of get_wrapper_codegen_for_device in {GRAPH}")
    if call.keywords:
        raise PatchError(f"{GRAPH}:{call.lineno}: the call already passes keywords")
    last = call.args[-1]
    assert last.end_lineno is not None and last.end_col_offset is not None
    row, col = last.end_lineno - 1, last.end_col_offset
    lines[row] = lines[row][:col] + ", aot_mode=self.aot_mode" + lines[row][col:]
    if len(lines[row]) > 88:
        raise PatchError(
            f"{GRAPH}:{row + 1}: the edited call no longer fits 88 columns"
        )
    tree.write(GRAPH, "\n".join(lines))


def _accept_both_wrappers_in_ir(tree: Tree) -> None:
    text = tree.read(IR)
    lines = text.split("\n")
    function = _function(ast.parse(text, IR), "try_get_kernel_name", IR)
    imports = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom)
        and node.module == "codegen.cpp_wrapper_cpu_aoti"
    ]
    node = _only(imports, f"import in {IR}:try_get_kernel_name")
    indent = re.match(r"\s*", lines[node.lineno - 1])
    assert indent is not None
    pad = indent.group(0)
    body = range(node.lineno, function.end_lineno or node.lineno)
    checks = [
        i for i in body if "isinstance(V.graph.wrapper_code, CppWrapperCpu)" in lines[i]
    ]
    if len(checks) != 1:
        raise PatchError(f"{IR}: expected one isinstance check in try_get_kernel_name")
    lines[checks[0]] = lines[checks[0]].replace(
        "isinstance(V.graph.wrapper_code, CppWrapperCpu)",
        "isinstance(V.graph.wrapper_code, cpp_wrappers)",
    )
    lines[node.lineno - 1] = (
        f"{pad}from .codegen.cpp_wrapper_cpu import CppWrapperCpu\n"
        f"{pad}from .codegen.cpp_wrapper_cpu_aoti import CppWrapperCpu as AotiCppWrapperCpu\n\n"
        f"{pad}# JIT graphs: CppWrapperCpu (CppWrapperGpu derives from it); AOTInductor\n"
        f"{pad}# and the other devices: the C-shim wrappers.\n"
        f"{pad}cpp_wrappers = (CppWrapperCpu, AotiCppWrapperCpu)"
    )
    tree.write(IR, "\n".join(lines))


# ---------------------------------------------------------------------------
# the series
# ---------------------------------------------------------------------------


@dataclass
class Step:
    subject: str
    body: str
    apply: Callable[[Tree], None]
    snapshot: dict[str, str | None] = field(default_factory=dict)


def _place(
    placed: Sequence[Placement], keep: Callable[[str], bool]
) -> Callable[[Tree], None]:
    def apply(tree: Tree) -> None:
        place_our_files(tree, placed, keep)

    return apply


def _is_codegen(target: str) -> bool:
    return target.startswith("torch/_inductor/codegen/")


def steps(tree: Tree) -> list[Step]:
    placed = placements(tree)
    moved = [w for w in JIT_WRAPPERS if w.path in {p.target for p in placed}]
    modules = " and ".join(f"{w.module}.py" for w in moved)
    devices = " and ".join(d.upper() for w in moved for d in w.devices)
    return [
        Step(
            "inductor: add the cppwrap runtime and its code cache",
            "cpp_wrapper=True builds each JIT graph into a Python extension module.\n"
            "What every such module needs (an owning tensor handle, error checks that\n"
            "become Python exceptions, unpacking the inputs without new handles) lives\n"
            "in a runtime extension, torch._inductor.runtime._C, built once per torch\n"
            "from torch/_inductor/runtime/cppwrap_*; generated modules then compile\n"
            "against light headers instead of the AOTI runtime.\n\n"
            "cppwrap_codecache.CppWrapperCodeCache builds and loads them: SHA-256\n"
            "keys over the sources and the full compile commands, a file lock per key\n"
            "with a timeout, atomic renames.  It is a new module because\n"
            "codecache.CppWrapperCodeCache still serves the C-shim wrappers (MPS, XPU).\n"
            "Nothing uses either yet.",
            _place(placed, lambda t: not _is_codegen(t)),
        ),
        Step(
            "inductor: move the C-shim C++ wrappers to *_aoti.py",
            f"{modules} hold the C-shim C++\n"
            "wrappers: what AOTInductor packages into a model .so, and the base of\n"
            "the MPS, XPU and MTIA wrappers.  Move them, changing only their\n"
            "cross-references, so that those paths can hold wrappers for JIT graphs;\n"
            "every importer follows.  No change in behaviour.",
            lambda tree: move_upstream_wrappers(tree, {p.target for p in placed}),
        ),
        Step(
            f"inductor: add C++ wrapper codegen for JIT graphs on {devices}",
            "With cpp_wrapper=True, a JIT graph's host code becomes one C++ function\n"
            "that borrows the caller's input tensors, releases the GIL while the\n"
            "kernels run and returns Python tensors built once: the C-shim wrapper\n"
            "allocates a heap handle and a capsule per tensor per call, which makes\n"
            "it slower than the Python wrapper on small CPU graphs.  The classes keep\n"
            "PythonWrapperCodegen's hooks (write_*, codegen_*, make_*, generate_*);\n"
            "C++ spellings live in small tables beside them; the CUDA wrapper adds\n"
            "only what CUDA needs (cubins launched from C++, streams, device guard).\n"
            "Not registered yet.",
            _place(placed, _is_codegen),
        ),
        Step(
            f"inductor: use the new C++ wrappers for JIT graphs on {devices}",
            "init_backend_registration registers them for "
            + ", ".join(d for w in moved for d in w.devices)
            + ", and\n"
            "get_wrapper_codegen_for_device takes the graph's aot_mode so that\n"
            "AOTInductor keeps the C-shim wrappers it packages into a .so.\n"
            "ExternKernel.try_get_kernel_name accepts either kind, since both name\n"
            "kernels by their C-shim functions.",
            register_jit_wrapper,
        ),
    ]


def _git(cwd: Path, *args: str, **env: str) -> str:
    base = {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CEILING_DIRECTORIES": str(cwd.parent),
        "GIT_AUTHOR_NAME": AUTHOR[0],
        "GIT_AUTHOR_EMAIL": AUTHOR[1],
        "GIT_COMMITTER_NAME": AUTHOR[0],
        "GIT_COMMITTER_EMAIL": AUTHOR[1],
        "GIT_AUTHOR_DATE": COMMIT_DATE,
        "GIT_COMMITTER_DATE": COMMIT_DATE,
        "LC_ALL": "C",
    }
    proc = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **base, **env},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise PatchError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr}")
    return proc.stdout


def _write_state(work: Path, state: dict[str, str | None]) -> None:
    for path, text in state.items():
        file = work / path
        if text is None:
            file.unlink(missing_ok=True)
        else:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(text.encode())


def build_series(site_packages: Path) -> dict[str, bytes]:
    """File name -> contents of the series for the torch under `site_packages`."""
    tree = Tree(site_packages)
    plan = steps(tree)
    for step in plan:
        step.apply(tree)
        step.snapshot = dict(tree.edits)
    version = torch_version_of(site_packages)
    with tempfile.TemporaryDirectory(prefix="cppwrap-series-") as tmp:
        work = Path(tmp) / "site-packages"
        work.mkdir()
        _git(work, "init", "-q")
        base = {p: tree.upstream(p) for p in tree.edits}
        _write_state(work, base)
        _git(work, "add", "-A")
        _git(work, "commit", "-q", "--allow-empty", "-m", f"torch {version}")
        for step in plan:
            _write_state(work, step.snapshot)
            _git(work, "add", "-A")
            _git(work, "commit", "-q", "-m", f"{step.subject}\n\n{step.body}\n")
        out = Path(tmp) / "out"
        _git(
            work,
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--full-index",
            "--find-renames",
            "--numbered",
            "-o",
            str(out),
            "HEAD~" + str(len(plan)),
        )
        files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    series = [
        f"# torch_cppwrap for torch {version}: apply in order from site-packages,",
        "# e.g. `git apply <patch>` or `patch -p1 < <patch>`.",
        "# Generated by `python tools/patches.py export`; do not edit.",
        *files,
    ]
    files[SERIES_FILE] = ("\n".join(series) + "\n").encode()
    return files


def read_series(directory: Path) -> list[str]:
    lines = (directory / SERIES_FILE).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def export(site_packages: Path, patches_dir: Path) -> Path:
    files = build_series(site_packages)
    directory = patches_dir / series_dir_name(torch_version_of(site_packages))
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        if old.is_file() and old.name not in files:
            old.unlink()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def _touched_paths(patch_text: str) -> list[str]:
    return [
        line.split(" ")[2][len("a/") :]
        for line in patch_text.splitlines()
        if line.startswith("diff --git a/")
    ]


def apply_series(directory: Path, site_packages: Path, into: Path) -> None:
    """Applies every patch of the series, in order, to the files under `into`;
    a file the series touches that `into` lacks is first copied from
    `site_packages`.  Raises PatchError naming the patch that fails."""
    directory, into = directory.resolve(), into.resolve()
    names = read_series(directory)
    for name in names:
        for path in _touched_paths((directory / name).read_text()):
            source, target = site_packages / path, into / path
            if source.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    patch = None
    try:
        for patch in (directory / name for name in names):
            _git(into, "apply", "--whitespace=nowarn", str(patch))
    except PatchError as error:
        raise PatchError(f"{patch} does not apply cleanly:\n{error}") from None


def _materialize(root: Path, path: str) -> None:
    """Makes every directory on the way to root/path a real one (its entries
    symlinked) and the file itself, if any, a real copy, so that patching it
    never writes through a link into the installed torch."""
    current = root
    for part in path.split("/"):
        current = current / part
        if not current.is_symlink():
            continue
        original = current.resolve()
        current.unlink()
        if original.is_dir():
            current.mkdir()
            for child in original.iterdir():
                (current / child.name).symlink_to(child)
        else:
            shutil.copy2(original, current)


def make_patched_torch(directory: Path, site_packages: Path, into: Path) -> Path:
    """Builds, in `into`, a torch that imports like the installed one but with
    the series applied: symlinks to the installed files, real copies of the
    ones the series touches.  Put `into` first on sys.path to use it (with
    PYTHONDONTWRITEBYTECODE=1, so no .pyc is written into the installed
    torch's __pycache__).  Returns `into`."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "torch").symlink_to(site_packages / "torch")
    for name in read_series(directory):
        for path in _touched_paths((directory / name).read_text()):
            _materialize(into, path)
    apply_series(directory, site_packages, into)
    return into


def check(site_packages: Path, patches_dir: Path) -> list[str]:
    """Problems with the committed series for this torch; empty if none."""
    directory = patches_dir / series_dir_name(torch_version_of(site_packages))
    if not (directory / SERIES_FILE).is_file():
        return [f"{directory} has no series: run `python tools/patches.py export`"]
    problems = []
    expected = build_series(site_packages)
    present = {p.name for p in directory.iterdir() if p.is_file()}
    for name in sorted(present | set(expected)):
        path = directory / name
        if name not in present:
            problems.append(f"{path} is missing")
        elif name not in expected:
            problems.append(f"{path} is stale: export no longer produces it")
        elif path.read_bytes() != expected[name]:
            diff = difflib.unified_diff(
                path.read_text().splitlines(),
                expected[name].decode().splitlines(),
                "committed",
                "export",
                n=1,
                lineterm="",
            )
            excerpt = "\n".join(list(diff)[:12])
            problems.append(
                f"{path} is stale: it differs from what export produces\n{excerpt}"
            )
    with tempfile.TemporaryDirectory(prefix="cppwrap-apply-") as tmp:
        try:
            apply_series(directory, site_packages, Path(tmp))
        except PatchError as error:
            problems.append(str(error))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/patches.py",
        description="torch_cppwrap as a patch series against torch/_inductor.",
    )
    parser.add_argument(
        "command",
        choices=["export", "check", "apply"],
        help="export: write the series for this torch; check: fail if it is stale "
        "or does not apply; apply DIR: build a patched torch overlay in DIR",
    )
    parser.add_argument("into", nargs="?", type=Path, help="for apply: a new directory")
    parser.add_argument(
        "--site-packages",
        type=Path,
        default=None,
        help="directory holding the torch/ to patch (default: the installed torch's)",
    )
    parser.add_argument(
        "--patches-dir",
        type=Path,
        default=DEFAULT_PATCHES_DIR,
        help=f"where the series live (default: {DEFAULT_PATCHES_DIR})",
    )
    args = parser.parse_args(argv)
    site_packages = args.site_packages or installed_site_packages()
    try:
        if args.command == "export":
            directory = export(site_packages, args.patches_dir)
            print(f"wrote {directory}: " + ", ".join(read_series(directory)))
            return 0
        if args.command == "apply":
            if args.into is None:
                parser.error("apply needs a directory to build the patched torch in")
            directory = args.patches_dir / series_dir_name(
                torch_version_of(site_packages)
            )
            into = make_patched_torch(directory, site_packages, args.into)
            print(
                f"PYTHONPATH={into} PYTHONDONTWRITEBYTECODE=1 python ... uses the patched torch"
            )
            return 0
        problems = check(site_packages, args.patches_dir)
    except PatchError as error:
        print(f"patches {args.command}: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"patches check: {problem}", file=sys.stderr)
    if problems:
        print(
            "patches check: refresh with `python tools/patches.py export`",
            file=sys.stderr,
        )
        return 1
    version = torch_version_of(site_packages)
    print(
        f"patches check: the series for torch {version} is current and applies cleanly"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
