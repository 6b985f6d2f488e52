"""torch_cppwrap as a patch series against torch's own ``torch/_inductor``.

    python tools/patches.py export [--site-packages DIR]   # write patches/torch-<X.Y>/
    python tools/patches.py check [--site-packages DIR]    # exit 1 if stale or broken
    python tools/patches.py apply DIR                      # a patched torch overlay

``export`` writes ``patches/torch-<X.Y>/``: ``git format-patch`` files and a
quilt-style ``series`` that turn the installed torch's Python sources into
torch_cppwrap's, the way an upstream pull request would.  ``check`` fails when
the committed series is stale (differs from what ``export`` produces now) or
does not apply cleanly.

The series is a table, :data:`SERIES`: each patch names the package's files
it adds and the edit it makes to upstream's files.  A new module of the
package goes into one patch's ``files`` (one line); a module in no patch
stops the export, naming itself.  A class too big for one patch (the CPU
wrapper) grows over several: a later patch names the ``sections`` it adds (a
section is a banner comment and what follows it), and until then the class
has, for each public method or base-class override of the section, a stub
that raises NotImplementedError (see :func:`hold_back`).

Our files are added beside upstream's; no upstream file is moved or renamed,
so AOTInductor and every out-of-tree importer (XPU, MTIA, PrivateUse1
backends) keep their paths and classes:

* ``_inductor/codegen/cpp_wrapper_cpu.py`` and ``cpp_wrapper_gpu.py`` ->
  ``torch/_inductor/codegen/cpp_wrapper_cpu_jit.py`` and
  ``cpp_wrapper_gpu_jit.py``, their classes renamed ``CppWrapperCpuJit`` and
  ``CppWrapperGpuJit`` (upstream's own variant is ``cpp_wrapper_cpu_array_ref``
  / ``CppWrapperCpuArrayRef``), so that torch has one class of each name
  (see :data:`JIT_WRAPPERS`);
* the other ``_inductor/codegen/*.py`` -> ``torch/_inductor/codegen/``;
* ``_inductor/runtime/*.h|.cpp`` -> ``torch/_inductor/runtime/``, the package
  that already holds what generated code needs at run time; the runtime
  extension becomes ``torch._inductor.runtime._C``;
* modules whose name would be ambiguous there get a ``cppwrap_`` prefix
  (:data:`TARGETS`): ``_inductor/codecache.py`` ->
  ``torch/_inductor/cppwrap_codecache.py`` (upstream's ``codecache.py`` keeps
  its ``CppWrapperCodeCache`` for the C-shim wrappers), ``_compat.py`` ->
  ``cppwrap_compat.py``, ...

The last patch registers our wrappers for JIT graphs on cpu and cuda in
``init_backend_registration``; ``get_wrapper_codegen_for_device`` takes the
graph's ``aot_mode`` so that AOTInductor keeps the C-shim wrappers it packages
into a model .so (what ``torch_cppwrap/_patching.py``'s selectors do at run
time).  The FX-graph cache needs no tag there: ``codecache.torch_key()``
already hashes torch's Python sources, ours included.

The edits to upstream files are anchored on what they change and fail with a
clear message when an anchor is missing, so a new torch release either
exports cleanly or says which edit needs attention.

This tool is not part of the package and never imports it (the import patches
torch): it reads the package's files.
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
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

_Node = TypeVar("_Node", bound=ast.AST)

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "torch_cppwrap"
PACKAGE_ROOT = REPO / PACKAGE
DEFAULT_PATCHES_DIR = REPO / "patches"
SERIES_FILE = "series"
# A patch of more changed lines than this adds a single file (checked by
# tests/test_patches.py): reviewers take patches of one job and a few hundred
# lines.
PATCH_LINE_LIMIT = 800

# Our dotted names that are not modules, and what they become upstream;
# module names derived from the file layout are added to this.
EXTRA_MODULE_NAMES = {
    # The runtime extension sits beside the sources it is built from.
    f"{PACKAGE}._C": "torch._inductor.runtime._C",
    # What registers our wrappers (prose such as "torch_cppwrap.patch()
    # registers it for cuda"): upstream, the device registry does.
    f"{PACKAGE}.patch": "torch._inductor.codegen.common.init_backend_registration",
}
EXPORTED_SUFFIXES = (".py", ".h", ".cpp")
# Files of the package that the series leaves out for now, and why
# ("_inductor/x.py": "reason").
DEFERRED: dict[str, str] = {
    "_inductor/graph.py": "the fallback to the Python wrapper for a graph ours cannot "
    "generate or build (with config.py's `strict`); upstream it belongs in "
    "GraphLowering.compile_to_module, a change of behaviour for every device that "
    "wants its own patch and review after this series",
    "_inductor/codegen/cpp_parallel_errors.py": "exceptions carried out of "
    "OpenMP-parallel kernel regions; the package patches Inductor's WorkSharing "
    "and CppKernelProxy.gen_body at import, upstream it is a direct edit of "
    "codegen/cpp.py that changes every C++ kernel's code and wants its own patch",
}


@dataclass(frozen=True)
class JitWrapper:
    """One of our C++ wrappers for JIT graphs, added beside the upstream
    C-shim wrapper of the same device as `<upstream>_jit.py`, class
    `<cls>Jit`, and registered for `devices`; AOTInductor keeps upstream's."""

    upstream: str  # upstream's module in torch/_inductor/codegen/, and ours
    cls: str  # upstream's class there, and ours in the package
    devices: tuple[str, ...]

    @property
    def module(self) -> str:
        return f"{self.upstream}_jit"

    @property
    def jit_cls(self) -> str:
        return f"{self.cls}Jit"

    @property
    def source(self) -> str:
        return f"_inductor/codegen/{self.upstream}.py"


JIT_WRAPPERS = (
    JitWrapper("cpp_wrapper_cpu", "CppWrapperCpu", ("cpu",)),
    JitWrapper("cpp_wrapper_gpu", "CppWrapperGpu", ("cuda",)),
)
# Our files (under torch_cppwrap/) whose path in torch is not the same path
# under torch/; any other file keeps its path (_inductor/x -> torch/_inductor/x).
TARGETS = {
    "_compat.py": "torch/_inductor/cppwrap_compat.py",
    "_inductor/codecache.py": "torch/_inductor/cppwrap_codecache.py",
    "_inductor/runtime/cuda_graphs.py": "torch/_inductor/runtime/cppwrap_cuda_graphs.py",
    **{w.source: f"torch/_inductor/codegen/{w.module}.py" for w in JIT_WRAPPERS},
}
# Our classes that would share a name with upstream's -> their name in torch.
CLASS_NAMES = {w.cls: w.jit_cls for w in JIT_WRAPPERS}
CPU_JIT = JIT_WRAPPERS[0]  # the CPU wrapper, which the CUDA one derives from
CPU_WRAPPER = CPU_JIT.source
COMMON = "torch/_inductor/codegen/common.py"
PATCHING = "_patching.py"  # under PACKAGE_ROOT
GRAPH = "torch/_inductor/graph.py"
IR = "torch/_inductor/ir.py"
COMPILE_FX = "torch/_inductor/compile_fx.py"

AUTHOR = ("torch_cppwrap developers", "dev@torch-cppwrap.local")
# Fixed, so that export is reproducible and `check` can compare bytes.
COMMIT_DATE = "2026-01-01T00:00:00+0000"


class PatchError(RuntimeError):
    """The series cannot be produced from these sources (an anchor moved, an
    unmapped reference to torch_cppwrap, a module in no patch, ...)."""


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
        self.edits: dict[str, str] = {}  # path -> text

    def exists(self, path: str) -> bool:
        return path in self.edits or (self.root / path).is_file()

    def read(self, path: str) -> str:
        if path in self.edits:
            return self.edits[path]
        try:
            return (self.root / path).read_bytes().decode()
        except FileNotFoundError:
            raise PatchError(f"upstream has no {path} under {self.root}") from None

    def upstream(self, path: str) -> str | None:
        file = self.root / path
        return file.read_bytes().decode() if file.is_file() else None

    def write(self, path: str, text: str) -> None:
        self.edits[path] = text


# ---------------------------------------------------------------------------
# our files, placed at upstream's paths
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    source: str  # under torch_cppwrap/
    target: str  # relative to site-packages

    @property
    def module(self) -> str | None:
        return _dotted(f"{PACKAGE}/{self.source}")

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


def _package_files(tree: Tree) -> list[str]:
    """The package's files under _inductor/ that the series must place: all
    but the empty __init__.py of a package upstream already has."""
    found = []
    for path in sorted((PACKAGE_ROOT / "_inductor").rglob("*")):
        if (
            not path.is_file()
            or path.suffix not in EXPORTED_SUFFIXES
            or "__pycache__" in path.parts
        ):
            continue
        rel = str(path.relative_to(PACKAGE_ROOT))
        if path.name == "__init__.py" and tree.exists("torch/" + rel):
            if path.read_text().strip():
                raise PatchError(
                    f"{path} is not empty, but upstream already has torch/{rel}; "
                    "move its contents into a module"
                )
            continue
        found.append(rel)
    return found


def placements(tree: Tree) -> dict[str, Placement]:
    """Where each file that SERIES places goes in torch, by its path under
    torch_cppwrap/.  Every file under _inductor/ must be in one patch (or
    DEFERRED), so that a new module cannot be left out by accident."""
    listed = [name for patch in SERIES for name in patch.files]
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if twice:
        raise PatchError(f"SERIES places {', '.join(twice)} more than once")
    missing = [name for name in listed if not (PACKAGE_ROOT / name).is_file()]
    if missing:
        raise PatchError(
            f"SERIES places {', '.join(missing)}, which {PACKAGE}/ does not have"
        )
    unplaced = [
        name
        for name in _package_files(tree)
        if name not in listed and name not in DEFERRED
    ]
    if unplaced:
        raise PatchError(
            f"{', '.join(PACKAGE + '/' + name for name in unplaced)} in no patch: "
            "add each to the `files` of a patch in SERIES (tools/patches.py), or "
            "to DEFERRED with the reason"
        )
    result = {}
    for name in listed:
        target = TARGETS.get(name, "torch/" + name)
        if tree.exists(target):
            raise PatchError(
                f"{PACKAGE}/{name} would overwrite upstream's {target}; give it "
                "a new name in TARGETS (tools/patches.py)"
            )
        result[name] = Placement(name, target)
    return result


def module_names(placed: Sequence[Placement]) -> dict[str, str]:
    """Our dotted module names -> theirs in torch, packages included."""
    names = dict(EXTRA_MODULE_NAMES)
    for item in placed:
        ours, theirs = item.module, item.target_module
        if ours is None or theirs is None:
            continue
        names[ours] = theirs
        if item.source in TARGETS:
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


def rename_classes(text: str, where: str) -> str:
    """Our classes that share a name with upstream's get their name in torch
    (CLASS_NAMES).  Only our files are renamed, so each must not refer to
    upstream's class of the same name."""
    for jit in JIT_WRAPPERS:
        upstream = f"torch._inductor.codegen.{jit.upstream}"
        if re.search(rf"{re.escape(upstream)}\b", text):
            raise PatchError(
                f"{where} refers to upstream's {upstream}, whose {jit.cls} it "
                f"would confuse with ours, renamed {jit.jit_cls}; refer to it "
                "in another way or teach rename_classes"
            )
    for ours, theirs in CLASS_NAMES.items():
        text = re.sub(rf"\b{ours}\b", theirs, text)
    return text


def place_files(
    tree: Tree,
    placed: dict[str, Placement],
    files: Sequence[str],
    to_come: dict[str, list[str]] | None = None,
) -> None:
    """Writes our `files` at their places, their references to any of our
    modules and classes rewritten, without the sections `to_come` names for
    each (added by later patches)."""
    names = module_names(list(placed.values()))
    base_methods = _base_methods(tree) if to_come else frozenset()
    for name in files:
        where = f"{PACKAGE}/{name}"
        text = (PACKAGE_ROOT / name).read_bytes().decode()
        if to_come and to_come.get(name):
            text = hold_back(text, to_come[name], base_methods, where)
        text = rename_classes(rewrite_references(text, names, where), where)
        tree.write(placed[name].target, text)


# ---------------------------------------------------------------------------
# a class added over several patches, a section of it at a time
# ---------------------------------------------------------------------------

# A section of a class body: its banner, three comment lines at method
# indentation, then everything up to the next banner or the end of the class.
_RULE = "    # " + "-" * 66
WRAPPER_BASE = ("torch/_inductor/codegen/wrapper.py", "PythonWrapperCodegen")


def section_spans(text: str) -> dict[str, tuple[int, int]]:
    """Section title -> (first line, line after the last) in `text`."""
    lines = text.splitlines(keepends=True)
    starts = [
        i
        for i in range(len(lines) - 2)
        if lines[i].rstrip() == _RULE
        and lines[i + 2].rstrip() == _RULE
        and lines[i + 1].startswith("    # ")
    ]
    spans = {}
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        for i in range(start + 3, end):  # the class ends at an unindented line
            if lines[i].strip() and not lines[i].startswith((" ", "\t")):
                end = i
                break
        spans[lines[start + 1][6:].strip()] = (start, end)
    return spans


def _members(body: Sequence[ast.stmt]) -> list[str]:
    """What a class body defines: its methods, and names bound to them."""
    names = []
    for node in body:
        if isinstance(node, ast.FunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return names


def _classes(text: str) -> list[ast.ClassDef]:
    return [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)]


def _base_methods(tree: Tree) -> frozenset[str]:
    path, cls = WRAPPER_BASE
    (node,) = [c for c in _classes(tree.read(path)) if c.name == cls]
    return frozenset(_members(node.body))


def _short(title: str) -> str:
    """A section's first two words: "control flow: ..." -> "control flow"."""
    return " ".join(re.findall(r"[a-z0-9]+", title.lower())[:2])


def hold_back(
    text: str, titles: Sequence[str], base_methods: frozenset[str], where: str
) -> str:
    """`text` without the class sections `titles`, as a patch before the one
    that adds them shows it: each section's public methods and overrides of
    `base_methods` raise NotImplementedError (a wrapper is registered only by
    the series' last patch, so nothing runs them), its private helpers are
    left out.  Fails when what stays calls a helper left out."""
    spans = section_spans(text)
    unknown = [t for t in titles if t not in spans]
    if unknown:
        raise PatchError(f"{where} has no section {', '.join(map(repr, unknown))}")
    lines = text.splitlines(keepends=True)
    removed: set[str] = set()
    for title in sorted(titles, key=lambda t: spans[t][0], reverse=True):
        start, end = spans[title]
        section = "".join(lines[start + 3 : end])
        names = _members(ast.parse(textwrap.dedent(section)).body)
        removed.update(names)
        short = _short(title)
        stub = f"_{short.replace(' ', '_')}_to_come"
        kept = [n for n in names if not n.startswith("_") or n in base_methods]
        replacement = [
            *lines[start : start + 3],
            "\n",
            f"    def {stub}(self, *args: Any, **kwargs: Any) -> Any:\n",
            f'        raise NotImplementedError("{short}: in a later patch")\n',
            "\n",
            *(f"    {name} = {stub}\n" for name in kept),
            "\n",
        ]
        lines[start:end] = replacement
    staged = "".join(lines)
    left = {name for cls in _classes(staged) for name in _members(cls.body)}
    dangling = sorted(
        name
        for name in removed - left
        if re.search(rf"\bself\.{re.escape(name)}\b", staged)
    )
    if dangling:
        raise PatchError(
            f"{where}: what comes before its sections {', '.join(map(repr, titles))} "
            f"calls {', '.join(dangling)}, defined in them; move each to a section "
            "of an earlier patch"
        )
    return staged


# ---------------------------------------------------------------------------
# edits to upstream's own files
# ---------------------------------------------------------------------------


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


def _mode_helper(wrappers: Sequence[JitWrapper]) -> list[str]:
    """get_wrapper_codegen_for_device's new helper, as lines of common.py."""
    imports, pairs = [], []
    for w in wrappers:
        imports.append(f"        from .{w.upstream} import {w.cls}")
        imports.append(f"        from .{w.module} import {w.jit_cls}")
        pairs.append(f"            {w.jit_cls}: {w.cls},")
    return [
        "def _cpp_wrapper_codegen_for_mode(",
        "    registered: WrapperConstructor | None, aot_mode: bool",
        ") -> WrapperConstructor | None:",
        '    """JIT graphs get the C++ wrappers that build a Python extension module',
        "    per graph (*_jit.py); AOTInductor keeps the C-shim wrappers, which it",
        "    packages into a model .so around the AOTI runtime.  A class registered",
        '    by anyone else serves both."""',
        "    if aot_mode:",
        *sorted(imports),
        "",
        "        aot_wrappers: dict[WrapperConstructor | None, WrapperConstructor] = {",
        *pairs,
        "        }",
        "        return aot_wrappers.get(registered, registered)",
        "    return registered",
        "",
        "",
    ]


def register_jit_wrappers(tree: Tree) -> None:
    """Registers our wrappers for JIT graphs on their devices, keeps
    upstream's for AOTInductor, and lets ExternKernel name C-shim kernels for
    both."""
    _register_in_common(tree)
    _pass_aot_mode_from_graph(tree)
    _accept_both_wrappers_in_ir(tree)
    _route_codegen_to_jit_wrapper(tree)
    _tune_jit_graphs_at_compile_time(tree)


def _register_in_common(tree: Tree) -> None:
    text = tree.read(COMMON)
    module = ast.parse(text, COMMON)
    lines = text.split("\n")

    # torch 2.15 moved the built-in devices' registrations out of
    # init_backend_registration into a helper it calls.
    registrar = next(
        (
            node.name
            for node in module.body
            if isinstance(node, ast.FunctionDef)
            and node.name == "_init_builtin_backend_registration"
        ),
        "init_backend_registration",
    )
    init = _function(module, registrar, COMMON)
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
    """Makes init_backend_registration register our class for
    wrapper.devices: imports it beside upstream's (in sorted place) and puts
    it in those devices' registrations only.  Lines gain text but are never
    added or removed, so the AST's line numbers stay valid."""
    imports = [
        node
        for node in init.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    ]
    upstream = [
        node
        for node in imports
        if node.module == wrapper.upstream
        and [a.name for a in node.names] == [wrapper.cls]
    ]
    _only(upstream, f"import of {wrapper.cls} in {COMMON}:{init.name}")
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
            f"{COMMON}: {init.name} does not register {wrapper.cls} "
            f"for {', '.join(wrapper.devices)}"
        )
    names = sorted(
        (n for d in wrapper.devices for n in uses[d]),
        key=lambda n: (n.lineno, n.col_offset),
        reverse=True,  # right to left: earlier columns stay valid
    )
    for name in names:
        assert name.end_col_offset is not None
        row = lines[name.lineno - 1]
        lines[name.lineno - 1] = (
            row[: name.col_offset] + wrapper.jit_cls + row[name.end_col_offset :]
        )
    # Sorted among the function's imports, as isort would put it.
    after = [node for node in imports if (node.module or "") > wrapper.module]
    anchor = after[0] if after else imports[-1]
    index = anchor.lineno - 1
    indent = re.match(r"\s*", lines[index])
    assert indent is not None
    new_import = f"{indent.group(0)}from .{wrapper.module} import {wrapper.jit_cls}"
    lines[index] = (
        f"{new_import}\n{lines[index]}" if after else f"{lines[index]}\n{new_import}"
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


def _tune_jit_graphs_at_compile_time(tree: Tree) -> None:
    """The JIT wrapper for CUDA tunes Triton kernels while the graph compiles:
    get_cpp_wrapper_config sets autotune_at_compile_time for every JIT graph
    where Triton is, whatever the user set (upstream's lazy compile at a
    kernel's first launch is not in the series); AOTInductor's graphs keep
    upstream's reading.  A default other than the two upstream spells
    (`has_triton()`, torch 2.11; `has_triton() and V.aot_compilation`, 2.12
    on) stops the export."""
    text = tree.read(COMPILE_FX)
    lines = text.split("\n")
    function = _function(
        ast.parse(text, COMPILE_FX), "get_cpp_wrapper_config", COMPILE_FX
    )
    choices = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.IfExp)
        and "autotune_at_compile_time"
        in (ast.get_source_segment(text, node.test) or "")
    ]
    choice = _only(choices, f"setting of autotune_at_compile_time in {COMPILE_FX}")
    default = choice.orelse

    def is_has_triton(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "has_triton"
        )

    if not (
        is_has_triton(default)
        or (
            isinstance(default, ast.BoolOp)
            and isinstance(default.op, ast.And)
            and len(default.values) == 2
            and is_has_triton(default.values[0])
            and ast.unparse(default.values[1]) == "V.aot_compilation"
        )
    ):
        raise PatchError(
            f"{COMPILE_FX}:{default.lineno}: unexpected default of "
            f"autotune_at_compile_time: {ast.unparse(default)}"
        )
    # The choice begins a line of its own (inside parentheses); the JIT case
    # goes in front of it, and upstream's choice becomes its `else`.
    first = lines[choice.lineno - 1]
    pad = first[: choice.col_offset]
    if pad.strip():
        raise PatchError(
            f"{COMPILE_FX}:{choice.lineno}: expected the setting of "
            "autotune_at_compile_time to begin its line"
        )
    lines[choice.lineno - 1 : choice.lineno] = [
        f"{pad}# The C++ wrapper for JIT graphs tunes Triton kernels while the",
        f"{pad}# graph compiles (in its first call), whatever the setting says.",
        f"{pad}True",
        f"{pad}if has_triton() and not V.aot_compilation",
        f"{pad}else {first[choice.col_offset :]}",
    ]
    tree.write(COMPILE_FX, "\n".join(lines))


def _accept_both_wrappers_in_ir(tree: Tree) -> None:
    text = tree.read(IR)
    lines = text.split("\n")
    function = _function(ast.parse(text, IR), "try_get_kernel_name", IR)
    imports = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom)
        and node.module == f"codegen.{CPU_JIT.upstream}"
        and [a.name for a in node.names] == [CPU_JIT.cls]
    ]
    node = _only(imports, f"import of {CPU_JIT.cls} in {IR}:try_get_kernel_name")
    indent = re.match(r"\s*", lines[node.lineno - 1])
    assert indent is not None
    pad = indent.group(0)
    body = range(node.lineno, function.end_lineno or node.lineno)
    check = f"isinstance(V.graph.wrapper_code, {CPU_JIT.cls})"
    checks = [i for i in body if check in lines[i]]
    if len(checks) != 1:
        raise PatchError(f"{IR}: expected one `{check}` in try_get_kernel_name")
    lines[checks[0]] = lines[checks[0]].replace(
        check, "isinstance(V.graph.wrapper_code, cpp_wrappers)"
    )
    lines[node.lineno - 1] += (
        f"\n{pad}from .codegen.{CPU_JIT.module} import {CPU_JIT.jit_cls}\n\n"
        f"{pad}# The C++ wrappers for AOTInductor and for JIT graphs (and those that\n"
        f"{pad}# derive from them) both name kernels by their C-shim functions.\n"
        f"{pad}cpp_wrappers = ({CPU_JIT.cls}, {CPU_JIT.jit_cls})"
    )
    tree.write(IR, "\n".join(lines))


def routed_codegen() -> dict[str, str]:
    """The package's ROUTED_CODEGEN (``_patching.py``): IR node class -> the
    method of our CPU wrapper that writes the node's call instead of the
    node's own codegen.  Read from the source, not imported."""
    text = (PACKAGE_ROOT / PATCHING).read_text()
    for node in ast.parse(text, PATCHING).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "ROUTED_CODEGEN"
            and node.value is not None
        ):
            table = ast.literal_eval(node.value)
            assert isinstance(table, dict)
            return table
    raise PatchError(f"{PACKAGE}/{PATCHING}: no ROUTED_CODEGEN table")


def _route_codegen_to_jit_wrapper(tree: Tree) -> None:
    """Each routed node's ``codegen`` hands the node to our CPU wrapper (and
    the CUDA one, its subclass) first, as ``_patching.py`` does at import.
    A class this release's IR lacks is skipped, as there."""
    text = tree.read(IR)
    lines = text.split("\n")
    classes = {
        node.name: node
        for node in ast.parse(text, IR).body
        if isinstance(node, ast.ClassDef)
    }
    inserts: list[tuple[int, str]] = []
    for class_name, method in routed_codegen().items():
        if class_name not in classes:
            continue
        codegens = [
            f
            for f in classes[class_name].body
            if isinstance(f, ast.FunctionDef) and f.name == "codegen"
        ]
        function = _only(codegens, f"{IR}: {class_name}.codegen")
        first = function.body[0]
        indent = re.match(r"\s*", lines[first.lineno - 1])
        assert indent is not None
        pad = indent.group(0)
        inserts.append(
            (
                first.lineno - 1,
                f"{pad}from .codegen.{CPU_JIT.module} import {CPU_JIT.jit_cls}\n\n"
                f"{pad}if isinstance(wrapper, {CPU_JIT.jit_cls}):\n"
                f"{pad}    wrapper.{method}(self)\n"
                f"{pad}    return",
            )
        )
    for row, block in sorted(inserts, reverse=True):
        lines[row] = f"{block}\n{lines[row]}"
    tree.write(IR, "\n".join(lines))


# ---------------------------------------------------------------------------
# the series
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Patch:
    """One patch of the series: one job, a few hundred lines."""

    subject: str  # after "[inductor] "
    body: str  # why; paragraphs split by blank lines, wrapped at export
    files: tuple[str, ...] = ()  # what it adds: the package's files (TARGETS)
    # What it adds to a file an earlier patch placed: (file, section title).
    sections: tuple[tuple[str, str], ...] = ()
    edit: Callable[[Tree], None] | None = None  # what it changes upstream

    def message(self) -> str:
        paragraphs = (" ".join(p.split()) for p in self.body.split("\n\n"))
        body = "\n\n".join(textwrap.fill(p, 72) for p in paragraphs)
        return f"[inductor] {self.subject}\n\n{body}\n"


# patch -> the package's files it adds (paths under torch_cppwrap/), in order.
SERIES: tuple[Patch, ...] = (
    Patch(
        "Add cppwrap_compat for the C++ wrapper of JIT graphs",
        """The C++ wrapper for JIT graphs that this series adds builds each graph
        into a Python extension module.  The few facts it needs that differ
        between torch releases (C-shim function names, cpp_builder's options,
        IR class names) are kept in one module, named for what each provides, so that
        the same sources serve every release the series is kept for; in
        tree, its helpers can be inlined.  Nothing uses it yet.""",
        files=("_compat.py",),
    ),
    Patch(
        "Add the C ABI headers of the cppwrap runtime",
        """A graph's wrapper module compiles in about a second only if it never
        includes an ATen header.  These headers are what it sees of libtorch
        besides Python.h and the AOTI C shim: the table of C functions the
        runtime extension exports (cppwrap_api.h), the dtype, layout and
        memory-format codes (cppwrap_dtypes.h), and lean versions of the size
        arithmetic that Inductor's C++ printer spells (cppwrap_sizes.h).

        Header-only; nothing includes them yet.""",
        files=(
            "_inductor/runtime/cppwrap_api.h",
            "_inductor/runtime/cppwrap_dtypes.h",
            "_inductor/runtime/cppwrap_sizes.h",
        ),
    ),
    Patch(
        "Add the cppwrap runtime extension",
        """Everything a generated wrapper needs that touches ATen (allocating
        tensors, dispatcher calls for ops without a C shim, turning C++
        errors into Python exceptions) lives in one translation unit, built
        once per torch and exported to the wrapper modules through a capsule
        (cppwrap_api.h), so that no wrapper module compiles against
        libtorch's headers.

        Nothing builds it yet: the code cache later in this series does.""",
        files=("_inductor/runtime/cppwrap_runtime_ext.cpp",),
    ),
    Patch(
        "Add the runtime header that generated C++ wrappers include",
        """The C-shim C++ wrapper allocates a heap handle and a capsule per
        tensor per call, which makes it slower per call than the Python
        wrapper on small CPU graphs.  cppwrap_runtime.h gives generated code
        an owning tensor type that lives on the stack, error checks that
        become Python exceptions, and the glue of a module's `call` entry
        point, which borrows the caller's tensors and builds the output tuple
        once.

        Nothing includes it yet.""",
        files=("_inductor/runtime/cppwrap_runtime.h",),
    ),
    Patch(
        "Add a code cache for C++ wrapper extension modules",
        """cppwrap_codecache.CppWrapperCodeCache builds a graph's wrapper and
        kernels into one Python extension module, compiling the two in
        parallel, and builds the runtime extension and the precompiled
        headers once per Inductor cache, all through cpp_builder: SHA-256
        keys over the sources and the full compile commands, a file lock per
        key with a timeout, atomic renames, and a size and digest check of
        each artefact before it is used.

        It is a new module because codecache.CppWrapperCodeCache keeps
        serving the C-shim wrappers (AOTInductor, MPS, XPU).  Nothing uses it
        yet.""",
        files=("_inductor/codecache.py",),
    ),
    Patch(
        "Add tables of C++ spellings for wrapper arguments",
        """How a dtype, a scalar, a tensor handle or an optional argument is
        spelled in C++ is data: one table of argument kinds (arg_kinds), small
        tables and one-line helpers, for the arguments of C-shim calls
        (shim_args), for the boxed dispatcher calls of ops without a shim
        (boxed_args), and the shim functions libtorch was built with
        (shim_catalog).  Kept apart from the wrapper classes,
        they let the CPU and CUDA wrappers differ only where the devices do.

        Nothing uses them yet.""",
        files=(
            "_inductor/codegen/cpp_spellings.py",
            "_inductor/codegen/arg_kinds.py",
            "_inductor/codegen/shim_catalog.py",
            "_inductor/codegen/shim_args.py",
            "_inductor/codegen/boxed_args.py",
        ),
    ),
    Patch(
        "Add a C++ wrapper for JIT graphs on CPU",
        """With cpp_wrapper=True, a JIT graph's host code becomes one C++
        function that borrows the caller's input tensors, frees buffers at
        their last use, releases the GIL while the kernels run and returns
        Python tensors built once; a wrong input raises a Python exception
        that says what was wrong.

        CppWrapperCpuJit overrides PythonWrapperCodegen's hooks (write_*,
        codegen_*, make_*, generate_*) as CppWrapperCpu does, and builds
        through cppwrap_codecache instead of the AOTI runtime.  CppWrapperCpu
        is unchanged: AOTInductor and the wrappers derived from it keep it.

        This patch covers graphs of Inductor's own kernels; the next three
        add extern kernels and fallback ops, device copies and layout checks,
        and control flow, whose hooks raise NotImplementedError until then.
        Not registered yet.""",
        files=("_inductor/codegen/cpp_wrapper_cpu.py",),
    ),
    Patch(
        "C++ wrapper for JIT graphs: extern kernels and fallback ops",
        """An op Inductor does not generate a kernel for is called through its
        C-shim function where torch has one (aoti_torch_cpu_mm_out, ...),
        otherwise boxed through the dispatcher, with its arguments pushed in
        C++; its failure raises the exception the op raised.  Collectives
        keep their work handles for the wait that follows.""",
        sections=((CPU_WRAPPER, "extern kernels and fallbacks"),),
    ),
    Patch(
        "C++ wrapper for JIT graphs: device copies, layout checks, unbacked sizes",
        """Copies between devices, assert_size_stride on an op's result, and
        the sizes a graph only knows once it runs (nonzero, a dynamic select
        or slice), read on the host into the C++ integers the rest of the
        graph uses.""",
        sections=(
            (CPU_WRAPPER, "device copies, layout checks and data-dependent sizes"),
        ),
    ),
    Patch(
        "C++ wrapper for JIT graphs: control flow",
        """torch.cond (and torch.switch where torch has it), while_loop and
        invoke_subgraph: each subgraph is generated inline as a C++ block of
        the same function, its inputs and outputs the outer graph's
        buffers.""",
        sections=((CPU_WRAPPER, "control flow: subgraphs inlined as C++ blocks"),),
    ),
    Patch(
        "Add the CUDA part of the cppwrap runtime",
        """What a CUDA wrapper module needs besides the CPU runtime: cubins
        loaded and launched through the driver API on the current stream and
        a device guard.

        Nothing uses it yet.""",
        files=("_inductor/runtime/cppwrap_cuda.h",),
    ),
    Patch(
        "Warm up and capture a CUDA wrapper module's graph",
        """cppwrap_cuda_graphs.warm_up and .capture are coroutines that a
        module's C++ drives: they hold torch's side of a CUDA graph (the
        memory pool the graphs of a stream share, the capture stream and the
        torch.cuda.CUDAGraph) and yield the inputs for C++ to run the
        kernels on, so nothing calls back into the module.  The warm-up runs
        in the pool, whose memory the capture then reuses.

        Nothing uses them yet.""",
        files=("_inductor/runtime/cuda_graphs.py",),
    ),
    Patch(
        "Replay a CUDA wrapper module's graph as one CUDA graph",
        """A graph whose inputs and outputs are CUDA tensors is warmed up on
        its first call, captured on its second (cppwrap::cuda::GraphReplay
        runs the kernels at each step of cppwrap_cuda_graphs' coroutines)
        and replayed from C++, with no Python, from the third; a graph
        compiled for dynamic shapes once per set of sizes (GraphReplays).

        Nothing uses it yet.""",
        files=("_inductor/runtime/cppwrap_cuda_graph.h",),
    ),
    Patch(
        "Add a C++ wrapper for JIT graphs on CUDA",
        """CppWrapperGpuJit is CppWrapperCpuJit plus what CUDA needs: each
        autotuned Triton kernel's cubin embedded in the module and launched
        from C++ with no Python per call, streams, the device guard, and
        CUDA-graph replay where the graph allows it.  CppWrapperGpu is
        unchanged for AOTInductor, XPU and MTIA.  Not registered yet.""",
        files=("_inductor/codegen/cpp_wrapper_gpu.py",),
    ),
    Patch(
        "Use the new C++ wrappers for JIT graphs on CPU and CUDA",
        """init_backend_registration registers CppWrapperCpuJit for cpu and
        CppWrapperGpuJit for cuda, and get_wrapper_codegen_for_device takes
        the graph's aot_mode, so that AOTInductor keeps CppWrapperCpu and
        CppWrapperGpu, which it packages into a model .so.  Other devices and
        out-of-tree backends keep what they register.

        ExternKernel.try_get_kernel_name accepts either kind of wrapper, since
        both name kernels by their C-shim functions.

        The codegen of two IR nodes hands the node to the JIT wrapper, which
        writes its call: InplaceBernoulliFallback (upstream spells that call
        for its own C-shim handle type) and _WaitKernel (torch 2.15 refuses
        C++ wrappers the wait of a coalesced collective, wait_tensors, which
        the JIT wrapper calls through the dispatcher).

        CppWrapperGpuJit tunes Triton kernels while the graph compiles, as
        AOTInductor does: get_cpp_wrapper_config sets
        autotune_at_compile_time for every JIT graph wherever Triton is,
        unset or False (upstream's lazy compile at a kernel's first launch);
        a JIT graph compiles in its first call, so it is tuned in that call
        either way.""",
        edit=register_jit_wrappers,
    ),
)


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


def _write_state(work: Path, state: dict[str, str]) -> None:
    for path, text in state.items():
        file = work / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(text.encode())


def build_series(site_packages: Path) -> dict[str, bytes]:
    """File name -> contents of the series for the torch under `site_packages`."""
    tree = Tree(site_packages)
    placed = placements(tree)
    to_come: dict[str, list[str]] = {}
    for patch in SERIES:
        for name, title in patch.sections:
            to_come.setdefault(name, []).append(title)
    seen: set[str] = set()
    snapshots = []
    for patch in SERIES:
        seen.update(patch.files)
        for name, title in patch.sections:
            if name not in seen:
                raise PatchError(
                    f"{patch.subject!r} adds a section to {name}, which no earlier "
                    "patch places"
                )
            to_come[name].remove(title)
        grown = list(dict.fromkeys(n for n, _ in patch.sections))
        place_files(tree, placed, [*patch.files, *grown], to_come)
        if patch.edit is not None:
            patch.edit(tree)
        snapshots.append(dict(tree.edits))
    version = torch_version_of(site_packages)
    with tempfile.TemporaryDirectory(prefix="cppwrap-series-") as tmp:
        work = Path(tmp) / "site-packages"
        work.mkdir()
        _git(work, "init", "-q")
        base = {p: text for p in tree.edits if (text := tree.upstream(p)) is not None}
        _write_state(work, base)
        _git(work, "add", "-A")
        _git(work, "commit", "-q", "--allow-empty", "-m", f"torch {version}")
        for patch, snapshot in zip(SERIES, snapshots, strict=True):
            _write_state(work, snapshot)
            _git(work, "add", "-A")
            _git(work, "commit", "-q", "-m", patch.message())
        out = Path(tmp) / "out"
        _git(
            work,
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--full-index",
            "--numbered",
            "-o",
            str(out),
            "HEAD~" + str(len(SERIES)),
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


def changed_lines(patch_text: str) -> int:
    """Lines a patch adds or removes (what `git diff --stat` counts)."""
    count, in_diff = 0, False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            in_diff = True
        elif in_diff and line.startswith(("+", "-")):
            count += not line.startswith(("+++ ", "--- "))
    return count


def table(directory: Path) -> str:
    """The series as a Markdown table: patch, files, changed lines."""
    rows = ["| patch | files | changed lines |", "| --- | --- | --: |"]
    for name in read_series(directory):
        text = (directory / name).read_text()
        files = ", ".join(f"`{p}`" for p in _touched_paths(text))
        rows.append(f"| {name} | {files} | {changed_lines(text)} |")
    return "\n".join(rows)


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
            print(f"wrote {directory}:\n{table(directory)}")
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
