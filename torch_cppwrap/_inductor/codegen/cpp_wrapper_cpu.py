"""torch_cppwrap's C++ wrapper codegen for CPU graphs.

Inductor drives a wrapper codegen through hooks (``write_*`` fills a section,
``codegen_*`` turns an IR node into text, ``make_*`` returns one line,
``generate_*`` emits calls).  :class:`CppWrapperCpu` overrides those hooks of
the generic :class:`PythonWrapperCodegen` so that the graph's host code comes
out as one C++ function, ``call_impl``, compiled with the graph's C++ kernels
into one extension module by our ``CppWrapperCodeCache``.

The shape of a generated module::

    from torch_cppwrap._inductor.codecache import CppWrapperCodeCache
    wrapper_src = r'''<C++: includes, kernel declarations, call_impl>'''
    kernel_src = r'''<C++: Inductor's kernels>'''
    _module = CppWrapperCodeCache.load(wrapper_src, kernel_src)
    call = _module.call

``call(args)`` takes Inductor's usual list of inputs and returns a tuple of
outputs; between those two points no Python runs and the GIL is released.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeGuard

import sympy
import torch
from torch._inductor import config, ir
from torch._inductor.codegen.common import IndentedBuffer
from torch._inductor.codegen.cpp_utils import cexpr
from torch._inductor.codegen.wrapper import (
    EnterSubgraphLine,
    ExitSubgraphLine,
    PythonWrapperCodegen,
    WrapperLine,
    codegen_reinterpret_view_helper,
)
from torch._inductor.utils import sympy_product
from torch._inductor.virtualized import V
from torch._prims import rng_prims
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._ordered_set import OrderedSet

from torch_cppwrap import _compat
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codegen import cpp_spellings as spell
from torch_cppwrap._inductor.codegen.arg_kinds import ShimHandle
from torch_cppwrap._inductor.codegen.boxed_args import push_argument
from torch_cppwrap._inductor.codegen.shim_args import shim_argument
from torch_cppwrap._inductor.codegen.shim_catalog import shim_function_exists

CPP_PREFIX_INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"

# Why a body cannot be captured as one CUDA graph, as recorded in
# CppWrapperCpu.replay_blockers.
HOST_READ = "the graph reads a value on the host"
DEVICE_COPY = "the graph copies between devices"
# Characters an op's handle name keeps (the rest become "_").
_IDENT_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
)


def _refers_by_name(node: Any, ref: str) -> bool:
    """Whether `ref`, the reference generated for `node`, names the variable
    holding node's tensor, rather than being an expression (a view of it, a
    size, None) that makes a new value."""
    try:
        return bool(ref == node.get_name())
    except (AttributeError, NotImplementedError):
        return False


class CppWrapperCpu(PythonWrapperCodegen):
    """Generates a graph's host wrapper as C++ for CPU."""

    device = "cpu"

    def __init__(self) -> None:
        # Set before super().__init__(), which calls write_header/write_prefix.
        self.entry = IndentedBuffer()  # input unpacking, with the GIL held
        # The graph's constants as the wrapper was created: name -> repr.
        self.constant_reprs: dict[str, str] = {}
        self.declared: OrderedSet[str] = OrderedSet()
        self.op_handles: dict[str, str] = {}
        self.boxed_call_ids = itertools.count()
        self.output_lines: list[str] = []
        self.output_kinds: list[str] = []
        self.output_objects: dict[int, str] = {}  # output index -> object input
        # Names of nodes that exist only to group a fallback's outputs; they
        # never hold a tensor, so freeing them is a no-op.
        self.virtual_buffers: OrderedSet[str] = OrderedSet()
        # Graph inputs held as cppwrap::Input (maybe borrowed from the caller).
        self.input_tensors: OrderedSet[str] = OrderedSet()
        # Graph inputs that are Python objects passed through (PyObject*).
        self.input_objects: OrderedSet[str] = OrderedSet()
        # The open subgraph blocks, outermost first (enter_block); and for
        # each subgraph made a C++ lambda, the blocks it is defined in.
        self.block_scopes: list[_BlockScope] = []
        self.block_ids = itertools.count()
        self.subgraph_functions: dict[str, list[int]] = {}
        # The collectives this graph issues and waits for, in program order
        # (op names): a fact for whoever must know that the graph
        # communicates, e.g. the CUDA wrapper's CUDA-graph replay.
        self.collective_ops: list[str] = []
        # What the body does that a CUDA graph cannot capture: a reason for
        # each such thing emitted, in program order (logged by the CUDA
        # wrapper, which replays a graph only when there is none).
        self.replay_blockers: list[str] = []
        # The kernels and C-shim functions the body calls, in program order,
        # each as (device type it runs on, function name).
        self.launches: list[tuple[str, str]] = []
        super().__init__()
        self.declare = "auto "
        self.declare_maybe_reference = "auto& "
        self.ending = ";"
        self.comment = "//"
        self.none_str = "nullptr"
        self.move_begin = "std::move("
        self.move_end = ")"
        self.supports_intermediate_hooks = False

    @classmethod
    def create(
        cls,
        is_subgraph: bool,
        subgraph_name: str | None,
        parent_wrapper: PythonWrapperCodegen | None,
        partition_signatures: Any = None,
    ) -> CppWrapperCpu:
        # A subgraph (torch.cond, torch.while_loop) is inlined into its
        # parent's C++ (codegen_subgraph), so its own wrapper writes nothing.
        if partition_signatures is not None:
            raise NotImplementedError(
                "torch_cppwrap: graph partitions are not supported by the C++ wrapper"
            )
        if config.triton.debug_sync_graph or config.triton.debug_sync_kernel:
            _compat.route_debug_sync(V.graph, cls.debug_sync_line())
        _refuse_higher_order_fallbacks(V.graph.operations)
        return cls()

    # config.profile_bandwidth: Inductor's start_graph()/end_graph() gather
    # what Triton kernels' Python launchers measure; a CPU graph has none.
    def generate_start_graph(self) -> None:
        pass

    def generate_end_graph(self) -> None:
        pass

    @classmethod
    def debug_sync_line(cls) -> str:
        """The C++ that Inductor's debug flags triton.debug_sync_graph and
        triton.debug_sync_kernel put after the graph and after each kernel,
        to wait for the device.  A CPU kernel has finished when it returns."""
        return "// triton.debug_sync_*: nothing to wait for on the CPU"

    def generate_debug_sync(self, buffer: IndentedBuffer) -> None:
        # torch 2.15's hook for those flags (_compat.route_debug_sync).
        buffer.writeline(self.debug_sync_line())

    # ------------------------------------------------------------------
    # sections
    # ------------------------------------------------------------------

    # What the generated C++ says about itself and includes; a device backend
    # overrides these two, not write_header.
    header_comment = (
        "// Host wrapper generated by torch_cppwrap: `call` unpacks the inputs,\n"
        "// runs the graph with the GIL released, and returns its outputs."
    )

    @property
    def runtime_header(self) -> str:
        """The one runtime header a unit of this device includes, first: the
        code cache precompiles it (codecache.WRAPPER_HEADERS)."""
        return codecache.WRAPPER_HEADERS[self.device]

    # Whether Inductor's Python tuning block (Triton kernels) is part of the
    # module; a CPU graph has none.
    uses_triton_tuning = False

    def write_header(self) -> None:
        context = torch._guards.TracingContext.try_get()
        graph_name = getattr(context, "aot_graph_name", None) if context else None
        if graph_name:
            # Upstream's line: tools that compare wrappers of two compiles
            # (PyTorch's tests among them) drop it by its prefix.
            self.imports.writeline(f"# AOT ID: {graph_name}")
        self.imports.writeline(
            f"# C++ wrapper generated by torch_cppwrap ({self.device})"
        )
        self.imports.writeline("import torch")
        self.imports.writeline(
            "from torch_cppwrap._inductor.codecache import CppWrapperCodeCache"
        )
        self.imports.writeline("")
        self.imports.writeline("wrapper_src = r'''")
        for line in self.header_comment.splitlines():
            self.header.writeline(line)
        self.header.writeline(f'#include "{self.runtime_header}"')
        self.header.writeline("")

    def write_constant(self, name: str, hashed: str) -> None:
        # Listed once the code is generated (see `constant_names`).  Not as
        # `hashed`: Inductor ends that with the tensor's id, which keeps the
        # Python modules of other constants apart.  Each load of a C++ module
        # binds its own constants (cppwrap::ModuleState), so the source
        # leaves the id out, and models of one shape, frozen in one process
        # or in several, build one library.
        value = V.graph.constants.get(name)
        self.constant_reprs[name] = (
            f"{value.dtype} {tuple(value.size())} {tuple(value.stride())} "
            f"on {value.device}"
            if isinstance(value, torch.Tensor)
            else ""
        )

    @property
    def constant_names(self) -> list[str]:
        """The constants the module binds: those still in the graph once its
        code is generated, which are those Inductor sets on the module.  A
        constant can leave the graph after the wrapper is created: a CPP GEMM
        template under freezing packs a weight into a new constant and drops
        the original."""
        graph = V.graph
        kept = (graph.constants, graph.torchbind_constants)
        return [n for n in self.constant_reprs if any(n in names for names in kept)]

    def write_kernel_autotune_defs_header(self) -> None:
        if self.uses_triton_tuning:
            super().write_kernel_autotune_defs_header()

    def generate_and_run_autotune_block(self) -> None:
        # Compile-time tuning runs Triton kernels (torch 2.11 turns it on
        # whenever Triton is installed); a CPU graph has none to tune.
        if self.uses_triton_tuning:
            super().generate_and_run_autotune_block()

    @functools.cached_property
    def _nested_int_inputs(self) -> set[str]:
        """The graph's int inputs that are nested ints: a jagged tensor's
        ragged size, a symbol with no value (the Python wrapper binds it and
        never reads it)."""
        return {
            str(node.target)
            for node in V.graph.graph.find_nodes(op="placeholder")
            if isinstance(val := node.meta.get("val"), torch.SymInt)
            and val.node.is_nested_int()
        }

    def get_graph_inputs(self) -> dict[str, Any]:
        # A nested int is an unused slot, as an input Inductor keeps no value
        # for (write_prefix); a wrapper that read its symbol would not build,
        # and the graph would fall back to the Python wrapper.
        inputs = super().get_graph_inputs()
        if not self._nested_int_inputs:
            return inputs
        return {k: v for k, v in inputs.items() if k not in self._nested_int_inputs}

    def write_prefix(self) -> None:
        inputs = self.get_graph_inputs()
        names = self.get_graph_input_names()
        self.entry.writeline(
            f"if (!cppwrap::check_args(args, {len(names)})) return nullptr;"
        )
        if any(not isinstance(value, sympy.Expr) for value in inputs.values()):
            # Python references to the inputs that are borrowed, not copied.
            self.entry.writeline(f"cppwrap::HeldInputs<{len(names)}> held;")
        unpacks = []
        for index, name in enumerate(names):
            value = inputs.get(name)
            if value is None:
                # Inductor keeps no value for a placeholder whose example is
                # None or a BackwardState (compiled autograd's hooks), and
                # get_graph_inputs leaves out nested ints: the graph never
                # reads them, so each slot is counted and passed over.
                self.entry.writeline(f"// args[{index}] ({name}): unused")
                continue
            if isinstance(value, sympy.Expr):
                ctype, fn = (
                    ("int64_t", "unpack_int")
                    if value.is_integer
                    else ("double", "unpack_float")
                )
                self.entry.writeline(f"{ctype} {name} = 0;")
            elif isinstance(
                value, (ir.TensorBox, ir.Buffer, ir.BaseView, ir.StorageBox)
            ):
                fn = "unpack_input"
                self.input_tensors.add(name)
                self.entry.writeline(f"cppwrap::Input {name};")
            elif isinstance(value, _compat.object_input_types()):
                fn = "unpack_object"
                self.input_objects.add(name)
                self.entry.writeline(f"PyObject* {name} = nullptr;")
            else:
                raise NotImplementedError(
                    f"torch_cppwrap: graph input {name} of kind "
                    f"{type(value).__name__} is not supported by the C++ wrapper"
                )
            self.declared.add(name)
            held = ", held" if fn in ("unpack_input", "unpack_object") else ""
            unpacks.append(
                f"!cppwrap::{fn}(args, {index}, {name}, {spell.string_literal(name)}{held})"
            )
        for index, unpack in enumerate(unpacks):
            first, last = index == 0, index == len(unpacks) - 1
            line = ("if (" if first else "    ") + unpack + (") {" if last else " ||")
            self.entry.writeline(line)
        if unpacks:
            self.entry.writeline("    return nullptr;")
            self.entry.writeline("}")
        self.entry.writeline("cppwrap::clear_args(args);")
        self.codegen_inputs()
        self.codegen_input_size_and_nan_asserts()

    def finalize_prefix(self) -> None:
        # Runs after the header and body are complete: wrap the prefix (symbol
        # bindings and input checks) in the opening of call_impl.
        code = IndentedBuffer()
        constant_names = self.constant_names
        for name in constant_names:
            code.writeline(f"// constant {name}: {self.constant_reprs[name]}")
        if constant_names:
            names = ", ".join(spell.string_literal(n) for n in constant_names)
            code.writeline(f"static const char* const constant_names[] = {{{names}}};")
        code.writeline("")
        for line in self.call_opening():
            code.writeline(line)
        with code.indent():
            code.splice(self.entry)
            if constant_names:
                # Kept in the module's state: each load of the library binds
                # its own (cppwrap::ModuleState).
                code.writeline(
                    "const cppwrap::Tensor* const constants = cppwrap::load_constants("
                    f"graph_module, constant_names, {len(constant_names)});"
                )
                code.writeline("if (constants == nullptr) return nullptr;")
                for index, name in enumerate(constant_names):
                    code.writeline(
                        f"const cppwrap::Tensor& {name} = constants[{index}];"
                    )
            for line in self.output_decls():
                code.writeline(line)
            code.writeline("try {")
            with code.indent():
                code.writeline("cppwrap::GilRelease nogil;")
                code.splice(self.prefix)
                opening = self.body_opening()
                for line in opening:
                    code.writeline(line)
                with code.indent(1 if opening else 0):
                    for line in self.body_prologue():
                        code.writeline(line)
        self.prefix = code

    def get_wrapper_call_indent(self) -> int:
        # Inside call_impl's try block, and the block body_opening opens.
        return 2 + bool(self.body_opening())

    # Where a device backend shapes the entry point; the defaults make one
    # METH_O `call_impl` that runs the body.
    def call_opening(self) -> list[str]:
        """The entry function's first lines, up to unpacking the inputs."""
        return ["static PyObject* call_impl(PyObject* graph_module, PyObject* args) {"]

    def body_opening(self) -> list[str]:
        """Lines after the input checks that open a block around the body."""
        return []

    def body_prologue(self) -> list[str]:
        """The body's first lines, inside the block body_opening opens."""
        return []

    def module_definition(self) -> list[str]:
        """What follows the entry function: the module's methods and init."""
        return ['CPPWRAP_DEFINE_MODULE("Inductor graph compiled by torch_cppwrap")']

    # ------------------------------------------------------------------
    # inputs
    # ------------------------------------------------------------------

    def codegen_input_symbol_assignment(
        self,
        name: str,
        value: Any,
        bound_vars: OrderedSet[sympy.Symbol],
        deferred_symbol_assignments: Any = None,
    ) -> None:
        # torch >= 2.14 passes a list for assignments to retry once more
        # symbols are bound; we bind what a dimension determines directly.
        code = self.prefix

        @functools.cache
        def sizes_of(tensor: str) -> str:
            code.writeline(f"const int64_t* {tensor}_size = {tensor}.sizes();")
            return f"{tensor}_size"

        @functools.cache
        def strides_of(tensor: str) -> str:
            code.writeline(f"const int64_t* {tensor}_stride = {tensor}.strides();")
            return f"{tensor}_stride"

        def bind(expr: sympy.Expr, source: str) -> None:
            if isinstance(expr, sympy.Symbol):
                if expr not in bound_vars:
                    code.writeline(f"int64_t {expr} = {source};")
                    bound_vars.add(expr)
                return
            free = [s for s in expr.free_symbols if s not in bound_vars]
            if len(free) != 1:
                return
            from torch.utils._sympy.solve import try_solve

            placeholder = sympy.Symbol(f"{name}_dim", integer=True)
            solution = try_solve(sympy.Eq(expr, placeholder), free[0])
            if solution is None:
                raise NotImplementedError(
                    f"torch_cppwrap: cannot recover {free[0]} from {expr} = {source}"
                )
            code.writeline(
                f"int64_t {free[0]} = {cexpr(solution[1].subs(placeholder, sympy.Symbol(source)))};"
            )
            bound_vars.add(free[0])

        if isinstance(value, sympy.Expr):
            if isinstance(value, sympy.Symbol) and value not in bound_vars:
                if str(value) != name:
                    ctype = "int64_t" if value.is_integer else "double"
                    code.writeline(f"{ctype} {value} = {name};")
                bound_vars.add(value)
            return
        if isinstance(value, ir.TensorBox):
            for dim, size in enumerate(value.get_size()):
                if isinstance(size, sympy.Expr) and size.free_symbols:
                    bind(size, f"{sizes_of(name)}[{dim}]")
            for dim, stride in enumerate(value.get_stride()):
                if isinstance(stride, sympy.Expr) and stride.free_symbols:
                    bind(stride, f"{strides_of(name)}[{dim}]")

    def codegen_input_size_and_nan_asserts(self) -> None:
        # Device and dtype are always checked: a kernel given a meta tensor,
        # or one on another device, would read memory that is not there.
        self.codegen_input_checks(layout=bool(config.size_asserts))
        if config.nan_asserts:
            self.codegen_input_nan_asserts()

    def codegen_input_size_asserts(self) -> None:
        self.codegen_input_checks(layout=True)

    def codegen_input_checks(self, layout: bool) -> None:
        """One check per tensor input: device and dtype, and with `layout`
        its sizes and strides (not for an empty tensor, whose strides are
        arbitrary)."""
        for name, buf in self.get_graph_inputs().items():
            if (
                not isinstance(buf, ir.TensorBox)
                or name not in V.graph.graph_input_names
            ):
                continue
            device = buf.get_device() or torch.device(self.device)
            args = [
                name,
                spell.string_literal(name),
                spell.dtype_code(buf.get_dtype()),
                spell.device_args(device),
            ]
            if layout and sympy_product(buf.get_size()) != 0:
                args.append(self.codegen_shape_tuple(buf.get_size()))
                args.append(self.codegen_shape_tuple(buf.get_stride()))
            self.prefix.writeline(f"cppwrap::check_input({', '.join(args)});")

    def codegen_deferred_input_asserts(self, input_names: Any) -> None:
        # Our input checks are all made up front, in codegen_input_size_asserts.
        pass

    def codegen_input_nan_asserts(self) -> None:
        # config.nan_asserts: each tensor input, and each tensor output
        # (generate_return), checked for NaN and inf, as the Python wrapper
        # checks them.
        for name, buf in self.get_graph_inputs().items():
            if isinstance(buf, ir.TensorBox) and name in V.graph.graph_input_names:
                self.prefix.writeline(self._nan_check(name, f"input {name}"))

    def _nan_check(self, tensor: str, what: str) -> str:
        return self._checked_shim_call(
            "aoti_torch_check_inf_and_nan",
            [spell.string_literal(tensor), f"{tensor}.get()"],
            f"{what}, which holds NaN or inf (config.nan_asserts)",
        )

    # ------------------------------------------------------------------
    # sizes and values
    # ------------------------------------------------------------------

    def codegen_cpp_sizevar(self, x: sympy.Expr, *, simplify: bool = True) -> str:
        if simplify:
            x = V.graph.sizevars.simplify(x)
        return cexpr(x)

    def codegen_sizevar(self, x: sympy.Expr) -> str:
        return self.codegen_cpp_sizevar(x)

    def codegen_shape_tuple(self, shape: Sequence[sympy.Expr]) -> str:
        return spell.initializer_list([self.codegen_sizevar(s) for s in shape])

    def codegen_tuple_access(self, basename: str, name: str, index: str) -> str:
        raise NotImplementedError(
            "torch_cppwrap: tuple outputs are unpacked at the call"
        )

    def codegen_dtype(self, dtype: torch.dtype) -> str:
        return spell.dtype_code(dtype)

    def codegen_device(self, device: torch.device) -> str:
        return spell.device_args(device)

    def codegen_layout(self, layout: torch.layout) -> str:
        return spell.LAYOUT_CODE[layout]

    def codegen_memory_format(self, memory_format: torch.memory_format) -> str:
        return spell.MEMORY_FORMAT_CODE[memory_format]

    def ensure_size_computed(self, sym: sympy.Symbol) -> None:
        from torch.utils._sympy.symbol import SymT, symbol_is_type

        if isinstance(sym, sympy.Symbol) and symbol_is_type(sym, SymT.PRECOMPUTED_SIZE):
            if sym in self.computed_sizes:
                return
            self.computed_sizes.add(sym)
            expr = V.graph.sizevars.inv_precomputed_replacements[sym]
            self.writeline(f"int64_t {sym} = {cexpr(expr)};")

    # ------------------------------------------------------------------
    # memory
    # ------------------------------------------------------------------

    def make_allocation(
        self,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        shape: Sequence[sympy.Expr],
        stride: Sequence[sympy.Expr],
        allocation_shape: Sequence[sympy.Expr] | None = None,
        is_pinned: bool = False,
    ) -> str:
        if is_pinned:
            raise NotImplementedError("torch_cppwrap: pinned buffers are not supported")
        self.declared.add(name)
        args = [self.codegen_shape_tuple(shape), self.codegen_shape_tuple(stride)]
        args.append(spell.dtype_code(dtype))
        if device.type != "cpu":
            args.append(spell.device_args(device))
        alloc = f"cppwrap::empty_strided({', '.join(args)})"
        if allocation_shape is not None and list(allocation_shape) != list(shape):
            padded = [self.codegen_shape_tuple(allocation_shape), args[1], *args[2:]]
            alloc = (
                f"cppwrap::reinterpret_view(cppwrap::empty_strided({', '.join(padded)}), "
                f"{args[0]}, {args[1]}, 0)"
            )
        return f"auto {name} = {alloc};"

    def make_buffer_free(self, buffer: Any) -> str:
        return self.make_free_by_names([buffer.get_name()])

    def make_free_by_names(self, names_to_del: list[str]) -> str:
        return " ".join(
            f"{name}.reset();" for name in names_to_del if self._holds_tensor(name)
        )

    def _holds_tensor(self, name: str) -> bool:
        """Whether freeing `name` releases a tensor: a node grouping a
        fallback's outputs holds none, and an object input is let go when
        call_impl returns, with the GIL."""
        return name not in self.virtual_buffers and name not in self.input_objects

    def make_buffer_reuse(self, old: Any, new: Any, delete_old: bool) -> str:
        old_name, new_name = old.get_name(), new.get_name()
        self.declared.add(new_name)
        # At the old buffer's last use (unless the graph returns it) its
        # tensor moves on to the new one.
        frees_old = (
            delete_old
            and old_name not in V.graph.get_output_names()
            and self._holds_tensor(old_name)
        )
        if old.get_size() == new.get_size() and old.get_stride() == new.get_stride():
            value = self._moved(old_name) if frees_old else f"{old_name}.clone_ref()"
            return f"auto {new_name} = {value};  // reuse"
        view = self.codegen_reinterpret_view(
            old, new.get_size(), new.get_stride(), 0, self.wrapper_call.writeline
        )
        free = f" {old_name}.reset();" if frees_old else ""
        return f"auto {new_name} = {view};{free}  // reuse"

    def make_tensor_alias(self, new_name: str, old_name: str, comment: str = "") -> str:
        self.declared.add(new_name)
        suffix = f"  // {comment}" if comment else ""
        return f"auto {new_name} = {self._as_lvalue_ref(old_name)}.clone_ref();{suffix}"

    def codegen_deferred_allocation(self, name: str, view: ir.ReinterpretView) -> None:
        from torch._inductor.codegen.wrapper import DeferredLine

        self.declared.add(name)
        self.writeline(
            DeferredLine(name, f"auto {name} = {self._owned(view)};  // alias")
        )

    def make_zero_buffer(self, name: str) -> str:
        return self._checked_shim_call("aoti_torch_zero_", [f"{name}.get()"], name)

    def codegen_alloc_from_pool(
        self,
        name: str,
        offset: sympy.Expr,
        dtype: torch.dtype,
        shape: Sequence[sympy.Expr],
        stride: Sequence[sympy.Expr],
    ) -> tuple[str, list[str]]:
        # config.memory_planning: a buffer placed in the pool `name`, which
        # make_allocation allocated.  The expression, and no lines before it.
        args = [
            name,
            self.codegen_sizevar(offset),  # in bytes
            spell.dtype_code(dtype),
            self.codegen_shape_tuple(shape),
            self.codegen_shape_tuple(stride),
        ]
        return f"cppwrap::alloc_from_pool({', '.join(args)})", []

    def codegen_reinterpret_view(
        self,
        data: Any,
        size: Sequence[sympy.Expr],
        stride: Sequence[sympy.Expr],
        offset: sympy.Expr,
        writeline: Callable[..., None],
        dtype: torch.dtype | None = None,
    ) -> str:
        d_size, d_stride, d_offset, d_dtype, collapsible = (
            codegen_reinterpret_view_helper(data)
        )
        name = data.get_name()
        if collapsible and offset == d_offset:
            same_layout = list(size) == list(d_size) and list(stride) == list(d_stride)
            base_dtype = d_dtype
        else:
            layout = data.layout
            same_layout = (
                list(size) == list(layout.size)
                and list(stride) == list(layout.stride)
                and offset == layout.offset
            )
            base_dtype = data.dtype
        expr = name
        if not same_layout:
            expr = (
                f"cppwrap::reinterpret_view({name}, {self.codegen_shape_tuple(size)}, "
                f"{self.codegen_shape_tuple(stride)}, {self.codegen_sizevar(offset)})"
            )
        if dtype is not None and dtype != base_dtype:
            expr = f"cppwrap::view_dtype({expr}, {spell.dtype_code(dtype)})"
        return expr

    def _moved(self, name: str) -> str:
        """An expression that moves the Tensor `name` out (an Input may be
        borrowed, so taking it may add a reference)."""
        return f"{name}.take()" if name in self.input_tensors else f"std::move({name})"

    @staticmethod
    def _owned(node: Any) -> str:
        """An expression for a new owned Tensor holding `node`'s value."""
        ref = node.codegen_reference()
        return f"{ref}.clone_ref()" if _refers_by_name(node, ref) else ref

    @staticmethod
    def _as_lvalue_ref(ref: str) -> str:
        return ref

    # ------------------------------------------------------------------
    # kernels
    # ------------------------------------------------------------------

    def _define_kernel_helper(
        self,
        kernel_name: str,
        kernel_body: str,
        metadata: str | None = None,
        gpu: bool = True,
        cpp_definition: str | None = None,
    ) -> None:
        if gpu or cpp_definition is None:
            raise NotImplementedError(
                f"torch_cppwrap: kernel {kernel_name} is not a C++ kernel; the CPU "
                "wrapper supports Inductor's C++ backend (config.cpu_backend='cpp')"
            )
        self.header.splice(cpp_definition)
        # One include of the kernels' prelude heads the kernel source (and
        # must come first for the precompiled header to apply).
        body = "\n".join(
            line
            for line in kernel_body.splitlines()
            if line.strip() != CPP_PREFIX_INCLUDE
        )
        self.kernel_declarations.splice(f"\n{body}\n")

    def _generate_kernel_call_helper(
        self,
        kernel_name: str,
        call_args: Sequence[Any],
        *,
        device: torch.device | None = None,
        triton: bool = True,
        arg_types: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if triton:
            raise NotImplementedError(
                f"torch_cppwrap: Triton kernel {kernel_name} on CPU is not supported"
            )
        assert arg_types is not None and len(arg_types) == len(call_args)
        args = []
        for arg, arg_type in zip(call_args, arg_types, strict=True):
            if isinstance(arg_type, str) and "*" in arg_type:
                args.append(f"({arg_type})({arg}.data_ptr())")
            elif isinstance(arg, sympy.Expr):
                args.append(self.codegen_sizevar(arg))
            else:
                args.append(str(arg))
        self.launches.append(((device or torch.device(self.device)).type, kernel_name))
        self.writeline(f"{kernel_name}({', '.join(args)});")

    def write_provenance_debug_handle(
        self, kernel_name: str, debug_handle: int | None = None
    ) -> None:
        pass

    # ------------------------------------------------------------------
    # extern kernels and fallbacks
    # ------------------------------------------------------------------

    @staticmethod
    def get_c_shim_func_name(kernel: str, device: str) -> str:
        """Maps Inductor's C++ kernel names (at::mm_out, at::_ops::x::call) to C
        shim functions (aoti_torch_cpu_mm_out, aoti_torch_cpu_x)."""
        if kernel.startswith("aoti_torch_"):
            return kernel
        if "::" not in kernel:
            raise NotImplementedError(f"torch_cppwrap: no C shim for kernel {kernel}")
        parts = kernel.split("::")
        op = parts[-2] if parts[-1] == "call" else parts[-1]
        return f"aoti_torch_{device}_{op}"

    def _shim_call(
        self, shim_fn: str, args: Sequence[str], where: str, device: str
    ) -> None:
        self.launches.append((device, shim_fn))
        self.write_kernel_line(shim_fn, self._checked_shim_call(shim_fn, args, where))

    def write_kernel_line(self, kernel: str, line: str) -> None:
        """Writes the statement `line` that runs `kernel`; with
        config.cpp.enable_kernel_profile, inside a profiler range named after
        it, as Inductor's C++ kernels record themselves (a C-shim call runs
        ATen's kernel without the dispatcher, so nothing else records it)."""
        if config.cpp.enable_kernel_profile:
            name = spell.string_literal(kernel)
            line = f"{{ cppwrap::RecordScope record_kernel({name}); {line} }}"
        self.writeline(line)

    def _generate_extern_kernel_out_helper(
        self,
        kernel: str,
        out: str,
        out_view: str | None,
        args: list[str],
        device: str,
        stack_traces: Any = None,
        profiling_args: Sequence[str | None] | None = None,
    ) -> None:
        # profiling_args (torch 2.15): the arguments a profiled extern call
        # records; this wrapper's range (write_kernel_line) records its name.
        if not shim_function_exists(kernel):
            raise NotImplementedError(f"torch_cppwrap: no C shim function {kernel}")
        # Inductor leaves a symbolic scalar (baddbmm's alpha with dynamic
        # shapes) as a sympy expression among the spelled arguments.
        args = [a if isinstance(a, str) else self.val_to_arg_str(a) for a in args]
        out_arg = f"{out}.get()"
        if out_view:
            view_name = f"{out}_as_strided"
            self.writeline(f"auto {view_name} = {out_view};")
            out_arg = f"{view_name}.get()"
        self._shim_call(kernel, [out_arg, *args], out, device)

    def _generate_extern_kernel_alloc_helper(
        self, extern_kernel: Any, args: list[str]
    ) -> None:
        op = extern_kernel.op_overload
        tags = op.tags if isinstance(op, torch._ops.OpOverload) else ()
        if torch.Tag.data_dependent_output in tags:
            self.replay_blockers.append(HOST_READ)
        if getattr(extern_kernel, "outputs", None):
            self.generate_c_shim_fallback_kernel(extern_kernel, args)
            return
        name = extern_kernel.get_name()
        kernel = extern_kernel.get_kernel_name()
        device = d.type if (d := extern_kernel.get_device()) else self.device
        if torch.Tag.inplace_view in tags:
            self._shim_call(kernel, args, name, device)
            return
        self.writeline(f"AtenTensorHandle {name}_handle = nullptr;")
        self._shim_call(kernel, [*args, f"&{name}_handle"], name, device)
        self.writeline(f"auto {name} = cppwrap::Tensor::adopt({name}_handle);")
        self.declared.add(name)

    def generate_c_shim_fallback_kernel(self, node: Any, args: list[str]) -> None:
        out_args: list[str] = []
        adopt: list[str] = []
        for index, out in enumerate(node.outputs):
            if isinstance(out, ir.MultiOutput):
                out_name = out.get_name()
                self.writeline(f"AtenTensorHandle {out_name}_handle = nullptr;")
                out_args.append(f"&{out_name}_handle")
                adopt.append(
                    f"auto {out_name} = cppwrap::Tensor::adopt({out_name}_handle);"
                )
                self.declared.add(out_name)
            elif isinstance(out, (int, sympy.Expr)):
                var = f"{node.get_name()}_{index}"
                value = (
                    cexpr(out)
                    if isinstance(out, sympy.Expr)
                    else spell.int_literal(out)
                )
                self.writeline(f"int64_t {var} = {value};")
                out_args.append(f"&{var}")
            elif out is None:
                out_args.append("nullptr")
            else:
                raise NotImplementedError(
                    f"torch_cppwrap: output {out!r} of {node.get_name()} is not supported"
                )
        self.virtual_buffers.add(node.get_name())
        device = d.type if (d := node.get_device()) else self.device
        shim_fn = self.get_c_shim_func_name(node.cpp_kernel_name, device)
        self._shim_call(shim_fn, [*args, *out_args], str(node.op_overload), device)
        for line in adopt:
            self.writeline(line)

    def generate_fallback_kernel(self, node: ir.FallbackKernel) -> None:
        op = node.op_overload
        device = d.type if (d := node.get_device()) else self.device
        if isinstance(op, torch._ops.OpOverload):
            shim_fn = _compat.c_shim_function_name(op, device)
            # Inductor asks for runtime dispatch where the shim cannot take an
            # argument (a complex number for a Scalar, which it spells double).
            if (
                shim_fn is None
                or not shim_function_exists(shim_fn)
                or getattr(node, "use_runtime_dispatch", False)
            ):
                # Not in the shim for this device: go through the dispatcher.
                self._generate_boxed_call(
                    node.get_name(),
                    op,
                    node.export_extern_kernel_node(),
                    node.outputs if node.outputs else node.mutation_outputs,
                )
                return
        super().generate_fallback_kernel(node)

    def codegen_inplace_bernoulli(self, node: Any) -> None:
        """aten.bernoulli_ on a buffer (config.fallback_random): upstream's IR
        spells this call itself, for its own handle type."""
        op = node.op_overload
        # Inductor never passes a generator; the schema's defaults fill the rest.
        values = _schema_values(op, [*node.inputs, *node.constant_args], {})
        device = d.type if (d := node.get_device()) else self.device
        shim_fn = _compat.c_shim_function_name(op, device)
        if shim_fn is None or not shim_function_exists(shim_fn):
            self._generate_boxed_call(node.get_name(), op, values, [])
            return
        args = [
            self.val_to_arg_str(value, arg.real_type)
            for value, arg in zip(values, op._schema.arguments, strict=True)
        ]
        self._shim_call(shim_fn, args, str(op), device)

    def codegen_collective_wait(self, node: Any) -> None:
        """A collective's wait: wait_tensor, or wait_tensors for the outputs
        of a coalesced collective (torch 2.15), which upstream's IR refuses
        C++ wrappers.  Both go through the dispatcher, as collectives do."""
        self.generate_extern_kernel_alloc(node)
        if isinstance(node.layout, ir.Layout):
            node.codegen_size_asserts(self)

    def generate_fallback_kernel_with_runtime_lookup(
        self,
        buf_name: str,
        python_kernel_name: str,
        get_args: Callable[[], Sequence[str]],
        op_overload: Any,
        raw_args: Sequence[Any],
        outputs: Sequence[Any],
    ) -> None:
        if op_overload in _RNG_STATE_WRAPPERS:
            self._generate_rng_state_wrapper(buf_name, op_overload, outputs)
            return
        if not isinstance(op_overload, torch._ops.OpOverload):
            raise NotImplementedError(
                f"torch_cppwrap: {python_kernel_name} is not supported by the C++ wrapper"
            )
        if _is_collective(op_overload):
            self.generate_collective(buf_name, op_overload, raw_args, outputs)
            return
        self._generate_boxed_call(buf_name, op_overload, raw_args, outputs)

    def _generate_rng_state_wrapper(
        self, buf_name: str, wrapper: Any, outputs: Sequence[Any]
    ) -> None:
        """Activation checkpointing's wrappers around a random op that the
        backward recomputes (with config.fallback_random): the forward's
        run_and_save_rng_state(op, *args) returns the generator's state from
        before the op, then the op's results; the backward's
        run_with_rng_state(state, op, *args) runs the op from that state and
        leaves the generator as it found it.  The op goes through the
        dispatcher, with the arguments the node holds (the flattened ones
        Inductor hands over drop the op's keyword arguments)."""
        node = V.graph.get_buffer(buf_name)
        assert isinstance(node, ir.FallbackKernel)
        args, kwargs = node.unflatten_args(node.inputs, node.constant_args)
        if wrapper is rng_prims.run_and_save_rng_state:
            state, (op, *op_args) = None, args
        else:
            state, (op, *op_args) = args[0], args[1:]
        values = _schema_values(op, op_args, kwargs)
        device = spell.device_args(
            _device_of(values) or node.get_device() or torch.device(self.device)
        )
        if state is None:
            state_out, op_outputs = outputs
            self.writeline(
                f"auto {state_out.get_name()} = cppwrap::get_rng_state({device});"
            )
            self.declared.add(state_out.get_name())
            self._generate_boxed_call(buf_name, op, values, op_outputs, result_depth=1)
            return
        before = f"{buf_name}_rng_before"
        self.writeline(f"auto {before} = cppwrap::get_rng_state({device});")
        self.writeline(
            f"cppwrap::set_rng_state({device}, {state.codegen_reference()});"
        )
        self._generate_boxed_call(buf_name, op, values, outputs)
        self.writeline(f"cppwrap::set_rng_state({device}, {before});")

    def generate_extern_kernel_alloc(self, node: ir.ExternKernelAlloc) -> None:
        # all_reduce_ and wait_tensor come here (their IR nodes name a C shim);
        # they go through the dispatcher like every other collective.
        op = getattr(node, "op_overload", None)
        if not _is_collective(op):
            super().generate_extern_kernel_alloc(node)
            return
        assert isinstance(node, ir.FallbackKernel)
        node.codegen_comment(self)
        self.generate_collective(
            node.get_name(),
            op,
            node.export_extern_kernel_node(),
            node.outputs or node.mutation_outputs,
        )

    def generate_collective(
        self,
        buf_name: str,
        op: torch._ops.OpOverload,
        raw_args: Sequence[Any],
        outputs: Any,
    ) -> None:
        """Issues a collective, or waits for one (wait_tensor), through the
        dispatcher, as the Python wrapper does, and where Inductor placed it:
        the kernels between a collective and its wait run while it
        communicates.  The call skips the ops' autograd kernels, written in
        Python (the graph is past autograd), so it needs no GIL, and the body
        runs with the GIL released: a wait never holds it (a process group
        written in Python takes it when it must)."""
        self.collective_ops.append(str(op))
        self._generate_boxed_call(buf_name, op, raw_args, outputs, below_autograd=True)

    def generate_scatter_fallback(self, node: Any) -> None:
        op = node.op_overload
        if not isinstance(op, torch._ops.OpOverload):
            op = _op_from_python_name(node.python_kernel_name)
        x, index = node.inputs[0], node.inputs[1]
        dim = node.constant_args[0]
        src = node.inputs[2] if node.src_is_tensor else node.constant_args[1]
        by_name = {"self": x, "dim": dim, "index": index, "src": src, "value": src}
        by_name.update({k: v for k, v in node.kwargs.items() if v is not None})
        values = [
            by_name.get(arg.name, arg.default_value) for arg in op._schema.arguments
        ]
        self._generate_boxed_call(node.get_name(), op, values, [])

    def generate_index_put_fallback(self, node: Any) -> None:
        op = node.op_overload
        valid = iter(node.inputs[2:])
        indices = [next(valid) if index is not None else None for index in node.indices]
        x, values = node.inputs[0], node.inputs[1]
        accumulate = node.constant_args[0] if node.constant_args else False
        self._generate_boxed_call(
            node.get_name(), op, [x, indices, values, accumulate], []
        )

    def _op_handle(self, op: torch._ops.OpOverload) -> str:
        key = str(op)
        if key not in self.op_handles:
            handle = "op_" + "".join(c if c in _IDENT_CHARS else "_" for c in key)
            self.op_handles[key] = handle
            schema = op._schema
            self.header.writeline(
                f"static void* {handle}() {{  // {key}\n"
                f"    static void* op = cppwrap::find_op({spell.string_literal(schema.name)}, "
                f"{spell.string_literal(schema.overload_name)});\n"
                "    return op;\n"
                "}"
            )
        return self.op_handles[key]

    def _generate_boxed_call(
        self,
        buf_name: str,
        op: torch._ops.OpOverload,
        raw_args: Sequence[Any],
        outputs: Any,
        *,
        below_autograd: bool = False,
        result_depth: int = 0,
    ) -> None:
        """A call through the dispatcher: arguments pushed by schema type,
        results read back into the output buffers (whose indices start
        `result_depth` levels above the op's results: an op that a
        higher-order op wraps)."""
        self.replay_blockers.append(f"{op} runs through the dispatcher")
        handle = self._op_handle(op)
        # The node groups its outputs, unless it is its own one output (as an
        # out-of-place collective is).
        if not any(
            isinstance(out, ir.Buffer) and out.get_name() == buf_name
            for out in _flatten(outputs)
        ):
            self.virtual_buffers.add(buf_name)
        call = f"{buf_name}_call"
        self.writeline(f"cppwrap::BoxedCall {call}({handle}());")
        pushes = [
            push_argument(self.codegen_sizevar, value, arg.real_type)
            for arg, value in zip(op._schema.arguments, raw_args, strict=True)
        ]
        run = "run_below_autograd" if below_autograd else "run"
        self.writeline(f"{call}{''.join(pushes)}.{run}();")
        if op._schema.returns:
            self._read_results(call, op, outputs, result_depth)
        self.writeline(f"{call}.finish();")

    def _read_results(
        self, call: str, op: torch._ops.OpOverload, outputs: Any, depth: int = 0
    ) -> None:
        returns = op._schema.returns
        for out in _flatten(outputs):
            if isinstance(out, ir.MultiOutput):
                # Its indices say where it sits: (tuple, i) picks the i-th
                # return, (list, j) the j-th element of a Tensor[] return.
                path = [(kind, i) for kind, i in out.indices[depth:]]
                if path and issubclass(path[0][0], tuple):
                    index, rest = path[0][1], path[1:]
                else:
                    index, rest = 0, path
                j = rest[0][1] if rest else -1
                if len(rest) > 1:
                    raise NotImplementedError(
                        f"torch_cppwrap: result {out.get_name()} of {op} is nested too deep"
                    )
                self._read_result(call, index, out, j)
            elif len(returns) == 1:
                self._read_result(call, 0, out, -1)

    def _read_result(self, call: str, index: int, out: Any, j: int) -> None:
        if out is None:
            return
        if isinstance(out, (list, tuple)):
            raise NotImplementedError(
                "torch_cppwrap: nested list results are not supported"
            )
        if isinstance(out, ir.MutationOutput):
            return  # the op wrote into an existing buffer
        name = out if isinstance(out, str) else out.get_name()
        if name in self.declared:
            return
        self.declared.add(name)
        self.writeline(f"auto {name} = {call}.tensor_result({index}, {j});")

    def codegen_multi_output(self, node: ir.MultiOutput) -> None:
        # The fallback's own call declares its outputs; this line runs in
        # program order, after it, and only checks (or aliases a lone output).
        self.writeline(_MultiOutputCheck(self, node))

    # ------------------------------------------------------------------
    # control flow: subgraphs inlined as C++ blocks
    # ------------------------------------------------------------------

    def codegen_conditional(self, conditional: Any) -> None:
        # torch.cond before torch 2.14: a predicate and two branches.
        predicate = self._branch_selector(conditional, conditional.predicate, "bool")
        self._codegen_branches(
            conditional,
            [
                (f"if ({predicate}) {{", conditional.true_subgraph),
                ("} else {", conditional.false_subgraph),
            ],
        )

    def codegen_switch(self, node: Any) -> None:
        # torch.cond and torch.switch from torch 2.14 on: branch i runs when
        # the selector is i, the last one otherwise.
        selector = self._branch_selector(node, node.selector, "int64_t")
        last = len(node.branches) - 1
        headers = [
            "} else {"
            if index == last and index > 0
            else f"{'} else ' if index else ''}if ({selector} == {index}) {{"
            for index in range(len(node.branches))
        ]
        self._codegen_branches(node, list(zip(headers, node.branches, strict=True)))

    def _branch_selector(self, node: Any, value: Any, ctype: str) -> str:
        """A C++ expression for the value choosing a branch: read on the host
        when it is a tensor."""
        if isinstance(value, ir.ShapeAsConstantBuffer):
            return f"static_cast<{ctype}>({value.codegen_reference()})"
        name = f"{node.get_name()}_selector"
        self.replay_blockers.append(HOST_READ)
        read = f"cppwrap::item_long({value.codegen_reference()})"
        if ctype == "bool":
            read += " != 0"
        self.writeline(f"const {ctype} {name} = {read};")
        return name

    def _codegen_branches(self, node: Any, branches: list[tuple[str, Any]]) -> None:
        outer_inputs = [self._owned(buf) for buf in node.operands]
        outer_outputs = []
        for out in node.outputs:
            self.writeline(f"cppwrap::Tensor {out.get_name()};")
            self.declared.add(out.get_name())
            outer_outputs.append(out.get_name())
        self.virtual_buffers.add(node.get_name())
        last = len(branches) - 1
        for index, (header, subgraph) in enumerate(branches):
            self.writeline(_EnterBlockLine(self, subgraph.graph, header))
            self.codegen_subgraph(subgraph, outer_inputs, outer_outputs)
            # The next branch's header closes this one's block.
            self.writeline(_ExitBlockLine(self, "}" if index == last else None))

    def codegen_while_loop(self, while_loop: Any, stack_output: bool = False) -> None:
        if stack_output:
            raise NotImplementedError(
                "torch_cppwrap: while_loop with stacked outputs is not supported by "
                "the C++ wrapper"
            )
        if getattr(while_loop, "mutation_outputs", None):
            raise NotImplementedError(
                "torch_cppwrap: a while_loop that mutates its carried inputs is not "
                "supported by the C++ wrapper"
            )
        name = while_loop.get_name()
        self.virtual_buffers.add(name)
        additional = [self._owned(buf) for buf in while_loop.additional_inputs]
        outputs = [out.get_name() for out in while_loop.outputs]
        # The carried values live in the loop's outputs: set to the initial
        # values here, to each iteration's results at the end of the body.
        for value, out in zip(while_loop.carried_inputs, outputs, strict=True):
            self.writeline(f"cppwrap::Tensor {out} = {self._owned(value)};")
            self.declared.add(out)
        cond_output = while_loop.cond_subgraph.graph.graph_outputs[0]
        result = f"{name}_cond"
        bool_predicate = isinstance(cond_output, ir.ShapeAsConstantBuffer)
        if not bool_predicate:
            self.replay_blockers.append(HOST_READ)
        self.writeline(
            f"bool {result} = false;"
            if bool_predicate
            else f"cppwrap::Tensor {result};"
        )
        inputs = [*(f"{out}.clone_ref()" for out in outputs), *additional]
        # The loop's block is the condition's; the body has a block of its
        # own inside it, where it may declare what the condition declared
        # (a stream, a kernel's size) again.
        cond_graph = while_loop.cond_subgraph.graph
        self.writeline(_EnterBlockLine(self, cond_graph, "while (true) {"))
        self.codegen_subgraph(while_loop.cond_subgraph, inputs, [result])
        check = result if bool_predicate else f"cppwrap::item_long({result}) != 0"
        self.writeline(f"if (!({check})) break;")
        self.writeline(_EnterBlockLine(self, while_loop.body_subgraph.graph))
        self.codegen_subgraph(while_loop.body_subgraph, inputs, outputs)
        self.writeline(_ExitBlockLine(self))
        self.writeline(_ExitBlockLine(self))

    def codegen_subgraph(
        self,
        subgraph: Any,
        outer_inputs: Sequence[str],
        outer_outputs: Sequence[str | None],
    ) -> None:
        """Inlines `subgraph` here, in a C++ block: its inputs are
        `outer_inputs`, expressions making new references to the outer
        values; its outputs are moved out into the `outer_outputs` (None:
        an output the caller spells itself, a size)."""
        graph = subgraph.graph
        self.writeline(f"// subgraph {subgraph.name}")
        inner = list(graph.graph_inputs.items())
        if len(inner) != len(outer_inputs):
            raise NotImplementedError(
                f"torch_cppwrap: subgraph {subgraph.name} takes {len(inner)} inputs "
                f"but is given {len(outer_inputs)}"
            )
        # Take the outer values first: an inner input may share its name.
        for (name, value), outer in zip(inner, outer_inputs, strict=True):
            if isinstance(value, ir.TensorBox):
                self.writeline(f"cppwrap::Tensor {name}_outer = {outer};")
        for name, value in inner:
            if isinstance(value, ir.TensorBox):
                self.writeline(f"cppwrap::Tensor {name} = std::move({name}_outer);")
        parent = V.graph
        saved_inputs, self.input_tensors = self.input_tensors, OrderedSet()
        try:
            self.push_codegened_graph(graph)
            with V.set_graph_handler(graph):
                graph.codegen_subgraph(parent_graph=parent)
            moved: set[str] = set()
            # As upstream: outer outputs past the subgraph's own (torch 2.14
            # adds some) are not assigned here.
            for output, target in zip(graph.graph_outputs, outer_outputs, strict=False):
                if target is None:  # the caller spells this output itself
                    continue
                ref = output.codegen_reference()
                if isinstance(output, ir.ShapeAsConstantBuffer):
                    self.writeline(f"{target} = {ref};")
                elif _refers_by_name(output, ref) and ref not in moved:
                    # The block's locals end here; the first use may move.
                    moved.add(ref)
                    self.writeline(f"{target} = std::move({ref});")
                else:
                    self.writeline(f"{target} = {self._owned(output)};")
        finally:
            self.input_tensors = saved_inputs
            self.pop_codegened_graph()

    def enter_block(self) -> None:
        """A subgraph's C++ block opens: what is declared in it ends with it,
        so the code after it, or a sibling block, declares its unbacked
        symbols, or the first device guard, again.  Called as the block's
        lines are written and again as they are emitted: Inductor declares
        names in both passes."""
        self.block_scopes.append(
            _BlockScope(
                next(self.block_ids),
                OrderedSet(self.unbacked_symbol_decls),
                self.last_seen_device_guard_index,
            )
        )

    def exit_block(self) -> None:
        scope = self.block_scopes.pop()
        self.unbacked_symbol_decls = scope.unbacked_symbols
        if scope.guard_index is None:
            self.last_seen_device_guard_index = None

    def _block_path(self) -> list[int]:
        return [scope.block_id for scope in self.block_scopes]

    def codegen_invoke_subgraph(self, invoke_subgraph: Any) -> None:
        """A nested compile region (torch.compiler.nested_compile_region): its
        subgraph becomes a C++ lambda, defined where it is first called and
        called there and at every later call, in that block or one inside it."""
        subgraph = invoke_subgraph.subgraph
        outputs = invoke_subgraph.outputs
        tensors = self._subgraph_tensor_outputs(subgraph.name, outputs)
        fn = f"{subgraph.name}_fn"
        defined_in = self.subgraph_functions.get(fn)
        if defined_in is None:
            self._define_subgraph_function(fn, subgraph, outputs)
        elif self._block_path()[: len(defined_in)] != defined_in:
            raise NotImplementedError(
                f"torch_cppwrap: {subgraph.name} is called outside the block of its "
                "first call, where the C++ wrapper defines it"
            )
        inner = subgraph.graph.graph_inputs.values()
        args = [
            self._owned(operand)
            for operand, value in zip(invoke_subgraph.inputs, inner, strict=True)
            if isinstance(value, ir.TensorBox)
        ]
        name = invoke_subgraph.get_name()
        self.virtual_buffers.add(name)
        self.writeline(f"auto {name} = {fn}({', '.join(args)});")
        for index, out in enumerate(tensors):
            self.writeline(f"auto {out.get_name()} = std::move({name}[{index}]);")
            self.declared.add(out.get_name())

    def _subgraph_tensor_outputs(self, name: str, outputs: Sequence[Any]) -> list[Any]:
        """The outputs a subgraph's lambda returns: its tensors. A size or a
        None it returns is an expression the caller spells itself, in
        symbols the caller has, unless one is bound inside the subgraph."""
        tensors = []
        for out in outputs:
            if isinstance(out, ir.MultiOutput):
                tensors.append(out)
            elif isinstance(out, ir.NoneAsConstantBuffer):
                continue
            elif not isinstance(out, ir.ShapeAsConstantBuffer) or any(
                str(symbol) not in self.unbacked_symbol_decls
                for symbol in free_unbacked_symbols(out.expr)
            ):
                raise NotImplementedError(
                    f"torch_cppwrap: {name} returns {type(out).__name__} "
                    f"{getattr(out, 'expr', '')}, which the C++ wrapper does not "
                    "pass out of a subgraph yet"
                )
        return tensors

    def _define_subgraph_function(
        self, fn: str, subgraph: Any, outputs: Sequence[Any]
    ) -> None:
        """`auto fn = [&](tensors...) { ...; return results; };`: the
        subgraph's code once, taking its tensor inputs (its sizes are the
        caller's, captured), returning its tensor outputs in order."""
        self.subgraph_functions[fn] = self._block_path()
        inner = subgraph.graph.graph_inputs.items()
        tensors = [name for name, value in inner if isinstance(value, ir.TensorBox)]
        params = ", ".join(f"cppwrap::Tensor {name}_arg" for name in tensors)
        self.writeline(
            _EnterBlockLine(self, subgraph.graph, f"auto {fn} = [&]({params}) {{")
        )
        returned = [isinstance(out, ir.MultiOutput) for out in outputs]
        self.writeline(f"std::array<cppwrap::Tensor, {sum(returned)}> results;")
        slots = itertools.count()
        self.codegen_subgraph(
            subgraph,
            [f"std::move({name}_arg)" if name in tensors else "" for name, _ in inner],
            [f"results[{next(slots)}]" if tensor else None for tensor in returned],
        )
        self.writeline("return results;")
        self.writeline(_ExitBlockLine(self, "};"))

    # ------------------------------------------------------------------
    # device copies, layout checks and data-dependent sizes
    # ------------------------------------------------------------------

    def codegen_device_copy(self, src: str, dst: str, non_blocking: Any) -> None:
        # DeviceCopy spells `dst` as a cppwrap::Tensor, InplaceCopyFallback as
        # a shim handle (through val_to_arg_str, as both spell `src` and the
        # flag).
        def handle(tensor: str) -> str:
            return tensor if isinstance(tensor, ShimHandle) else f"{tensor}.get()"

        self.replay_blockers.append(DEVICE_COPY)
        if isinstance(non_blocking, str):
            flag = non_blocking
        else:
            flag = "1" if non_blocking else "0"
        args = [handle(dst), handle(src), flag]
        self.writeline(self._checked_shim_call("aoti_torch_copy_", args, dst))

    def write_assert_size_stride(
        self,
        name: str,
        size: str,
        stride: str,
        op_name: str,
        dtype: torch.dtype | None = None,
    ) -> None:
        # torch 2.14 passes the dtype too, when the op's output dtype is worth
        # checking.
        self.writeline(
            self._assert_size_stride_line(name, size, stride, op_name, dtype)
        )

    def _codegen_assert_size_stride(
        self,
        code: Any,
        name: str,
        size: str,
        stride: str,
        op_name: str,
        dtype: torch.dtype | None = None,
    ) -> None:
        code.writeline(
            self._assert_size_stride_line(name, size, stride, op_name, dtype)
        )

    def _codegen_assert_alignment(
        self, code: Any, name: str, alignment: int, op_name: str
    ) -> None:
        # torch 2.15 asks C++ wrappers too for the alignment checks of
        # config.alignment_asserts (earlier releases skip them for them).
        code.writeline(
            f"cppwrap::assert_alignment({name}, {alignment}, "
            f"{spell.op_label(op_name or name)});"
        )

    @staticmethod
    def _assert_size_stride_line(
        name: str, size: str, stride: str, op_name: str, dtype: torch.dtype | None
    ) -> str:
        dtype_arg = "" if dtype is None else f", {spell.dtype_code(dtype)}"
        return (
            f"cppwrap::assert_size_stride({name}, {size}, {stride}, "
            f"{spell.op_label(op_name or name)}{dtype_arg});"
        )

    def codegen_dynamic_select_index(self, node: Any, clamp: bool) -> None:
        """The offset of an index chosen at run time (an unbacked symbol)."""
        sym = str(node.unbacked_offset_symbol)
        size = self.codegen_sizevar(sympy.sympify(node.size))
        index = self.codegen_sizevar(sympy.sympify(node.index))
        self.writeline(
            f"int64_t {sym}_index = {index} < 0 ? {index} + {size} : {index};"
        )
        if clamp:
            self.writeline(f"{sym}_index = cppwrap::clamp_index({sym}_index, {size});")
        base = self.codegen_sizevar(sympy.sympify(node.base_offset))
        stride = self.codegen_sizevar(sympy.sympify(node.base_dim_stride))
        self.writeline(f"int64_t {sym} = {base} + {stride} * {sym}_index;")
        self.unbacked_symbol_decls.add(sym)

    def codegen_dynamic_slice_size(self, node: Any) -> None:
        """The length of a slice whose bounds are known only at run time."""
        sym = str(node.unbacked_size_symbol)
        size = self.codegen_sizevar(sympy.sympify(node.size))
        for end, value in (("start", node.start), ("end", node.end)):
            bound = self.codegen_sizevar(sympy.sympify(value))
            self.writeline(
                f"int64_t {sym}_{end} = cppwrap::clamp_index("
                f"{bound} < 0 ? {bound} + {size} : {bound}, {size});"
            )
        span = f"{sym}_end - {sym}_start"
        if node.step != 1:
            step = self.codegen_sizevar(sympy.sympify(node.step))
            span = f"({span} + {step} - 1) / {step}"
        # A negative span means an empty slice, however it rounds.
        self.writeline(f"int64_t {sym} = std::max<int64_t>(0, {span});")
        self.unbacked_symbol_decls.add(sym)

    def _codegen_dynamic_scalar(self, node: Any) -> None:
        """An unbacked symbol read from a 0-d tensor (`.item()`, `.tolist()`)."""
        from torch.fx.experimental.symbolic_shapes import ConvertIntKey, DivideByKey

        (data,) = (t.codegen_reference() for t in node.inputs)
        sym = str(node.sym)
        self.unbacked_symbol_decls.add(sym)
        self.virtual_buffers.add(node.get_name())
        self.replay_blockers.append(HOST_READ)
        keypath = tuple(node.keypath)
        if not keypath:
            if node.inputs[0].get_dtype().is_floating_point:
                self.writeline(f"double {sym} = cppwrap::item_double({data});")
            else:
                self.writeline(f"int64_t {sym} = cppwrap::item_long({data});")
        elif len(keypath) == 1 and isinstance(keypath[0], ConvertIntKey):
            self.writeline(f"int64_t {sym} = cppwrap::item_long({data}) != 0 ? 1 : 0;")
        elif len(keypath) == 1 and isinstance(keypath[0], DivideByKey):
            divisor = spell.int_literal(int(keypath[0].divisor))
            undivided = f"{sym}_undivided"
            self.writeline(f"int64_t {undivided} = cppwrap::item_long({data});")
            message = spell.string_literal(f" is not divisible by {keypath[0].divisor}")
            self.writeline(
                f"if ({undivided} % {divisor} != 0) {{ throw cppwrap::Error("
                f"std::to_string({undivided}) + {message}); }}"
            )
            self.writeline(f"int64_t {sym} = {undivided} / {divisor};")
        else:
            raise NotImplementedError(
                f"torch_cppwrap: unbacked symbol {sym} from key path {keypath}"
            )

    def codegen_unbacked_symbol_decl(self, symbol: sympy.Symbol) -> str:
        name = str(symbol)
        if name in self.unbacked_symbol_decls:
            return name
        self.unbacked_symbol_decls.add(name)
        return f"int64_t {name}"

    # ------------------------------------------------------------------
    # C-shim calls and their arguments
    # ------------------------------------------------------------------

    @staticmethod
    def _checked_shim_call(shim_fn: str, args: Sequence[str], where: str) -> str:
        """A statement calling `shim_fn`; its failure names it and `where`
        (the op, or the buffer it computes) in the words of upstream's check,
        which PyTorch's tests match (`aoti_torch_cpu_x(...) API call
        failed`).  The function's name appears once, in the call, as in
        upstream's source, where PyTorch's tests count calls."""
        call = f"{shim_fn}({', '.join(args)})"
        return f"CPPWRAP_CHECK_SHIM({spell.string_literal(where)}, {call});"

    def val_to_arg_str(self, val: Any, type_: Any = None) -> str:
        return shim_argument(self.codegen_sizevar, val, type_)

    # ------------------------------------------------------------------
    # outputs and the end of the module
    # ------------------------------------------------------------------

    def output_decls(self) -> list[str]:
        decls = []
        for index, kind in enumerate(self.output_kinds):
            if kind == "tensor":
                decls.append(f"cppwrap::Tensor out{index};")
            elif kind in ("int", "float"):
                ctype = "int64_t" if kind == "int" else "double"
                decls.append(f"{ctype} out{index} = 0;")
        return decls

    def generate_return(self, output_refs: list[str]) -> None:
        # Outputs that read a buffer (views, scalars, constants) are taken
        # before any buffer is moved out, and repeats of an output last: an
        # output may be a view of a buffer that is itself an output.
        reads, moves, repeats = IndentedBuffer(), IndentedBuffer(), IndentedBuffer()
        self._generate_outputs(output_refs, reads, moves, repeats)
        for part in (reads, moves, repeats):
            self.wrapper_call.splice(part)
        if config.nan_asserts:
            for index, kind in enumerate(self.output_kinds):
                if kind == "tensor":
                    self.wrapper_call.writeline(
                        self._nan_check(f"out{index}", f"output {index}")
                    )

    def _generate_outputs(
        self,
        output_refs: list[str],
        reads: IndentedBuffer,
        moves: IndentedBuffer,
        repeats: IndentedBuffer,
    ) -> None:
        seen: dict[str, int] = {}
        constants = set(self.constant_names)
        outputs = zip(output_refs, V.graph.graph_outputs, strict=True)
        for index, (ref, node) in enumerate(outputs):
            if isinstance(node, ir.NoneAsConstantBuffer):
                self.output_kinds.append("none")
                continue
            if ref in self.input_objects:
                self.output_kinds.append("object")
                self.output_objects[index] = ref
                continue
            if isinstance(node, ir.ShapeAsConstantBuffer):
                expr = node.expr if hasattr(node, "expr") else node.shape
                kind = "int" if getattr(expr, "is_integer", True) else "float"
                self.output_kinds.append(kind)
                reads.writeline(f"out{index} = {ref};")
                continue
            self.output_kinds.append("tensor")
            if ref in seen:
                repeats.writeline(f"out{index} = out{seen[ref]}.clone_ref();")
                continue
            if not _refers_by_name(node, ref):
                reads.writeline(f"out{index} = {ref};")
            elif ref in constants:
                reads.writeline(f"out{index} = {ref}.clone_ref();")
            else:
                moves.writeline(f"out{index} = {self._moved(ref)};")
            seen[ref] = index

    def generate_before_suffix(self, result: IndentedBuffer) -> None:
        items = []
        for index, kind in enumerate(self.output_kinds):
            if kind == "none":
                items.append("cppwrap::output_none()")
            elif kind == "object":
                items.append(f"cppwrap::output_object({self.output_objects[index]})")
            else:
                items.append(f"cppwrap::output(out{index})")
        n = len(items)
        packed = ", ".join(items)
        if self.body_opening():
            result.writeline("        }")
        result.writeline("    } catch (...) {")
        result.writeline("        return cppwrap::raise_current();")
        result.writeline("    }")
        result.writeline(f"    return cppwrap::pack_outputs<{n}>({{{packed}}});")
        result.writeline("}")
        result.writeline("")
        for line in self.module_definition():
            result.writeline(line)

    def generate_end(self, result: IndentedBuffer) -> None:
        result.writeline("'''")
        kernels = self.kernel_declarations.getvalue().strip()
        self.kernel_declarations.clear()
        result.writeline("")
        result.writeline("kernel_src = r'''")
        if kernels:
            result.writeline(CPP_PREFIX_INCLUDE)
            result.splice(kernels)
        result.writeline("'''")
        load_args = "wrapper_src, kernel_src"
        launchers = self.define_launchers()
        if launchers:
            # One literal a launcher: the code cache groups them into
            # translation units that compile side by side.
            result.writeline("")
            result.writeline("launcher_src = [")
            for launcher in launchers:
                result.writeline("r'''")
                result.splice(launcher)
                result.writeline("''',")
            result.writeline("]")
            load_args += ", launchers=launcher_src"
        if self.constant_names:
            load_args += ", binds_constants=True"
        result.splice(
            f"""

            _module = CppWrapperCodeCache.load({load_args}, device_type={self.device!r})
            _module.bind_constants(globals())
            call = _module.call
            """
        )

    def define_launchers(self) -> list[str]:
        """The definition of each kernel launcher the wrapper declares (a
        CUDA graph's Triton kernels); none on CPU."""
        return []

    # Python-only hooks that have no C++ counterpart here.
    def generate_reset_kernel_saved_flags(self) -> None:
        pass

    def generate_save_uncompiled_kernels(self) -> None:
        pass

    def write_async_compile_wait(self) -> None:
        pass

    def write_triton_header_once(self) -> None:  # type: ignore[override]
        if self.uses_triton_tuning:
            super().write_triton_header_once()

    def codegen_device_guard_enter(
        self, device_idx: int, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def codegen_device_guard_exit(self) -> None:
        pass

    def generate_profiler_mark_wrapper_call(self, stack: Any) -> None:
        # The range the Python wrapper opens, so profiles read the same.
        name = f"graph_{V.graph.graph_id}_inductor_wrapper_call"
        self.wrapper_call.writeline(
            f"cppwrap::RecordScope record_call({spell.string_literal(name)});"
        )


def _flatten(values: Any) -> list[Any]:
    if isinstance(values, (list, tuple)):
        return [item for value in values for item in _flatten(value)]
    return [values]


class _BlockScope(NamedTuple):
    """An open subgraph block, and what was declared outside it."""

    block_id: int
    unbacked_symbols: OrderedSet[str]
    guard_index: int | None


@dataclasses.dataclass
class _EnterBlockLine(EnterSubgraphLine):
    """Opens the C++ block a subgraph is inlined into (`header`) and puts
    the subgraph's lines one level in."""

    wrapper: CppWrapperCpu
    header: str = "{"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.wrapper.enter_block()

    def codegen(self, code: IndentedBuffer) -> None:
        code.writeline(self.header)
        super().codegen(code)
        self.wrapper.enter_block()


@dataclasses.dataclass
class _ExitBlockLine(ExitSubgraphLine):
    """Ends the subgraph's lines; closes its block with `footer` unless the
    next block's header does (`} else {`)."""

    wrapper: CppWrapperCpu
    footer: str | None = "}"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.wrapper.exit_block()

    def codegen(self, code: IndentedBuffer) -> None:
        super().codegen(code)
        self.wrapper.exit_block()
        if self.footer is not None:
            code.writeline(self.footer)


class _MultiOutputCheck(WrapperLine):
    def __init__(self, wrapper: CppWrapperCpu, node: ir.MultiOutput) -> None:
        self.wrapper = wrapper
        self.node = node

    def codegen(self, code: IndentedBuffer) -> None:
        name = self.node.get_name()
        if name in self.wrapper.declared:
            return
        parent = self.node.input_name(0)
        if not self.node.indices and parent in self.wrapper.declared:
            self.wrapper.declared.add(name)
            code.writeline(f"auto {name} = {parent}.clone_ref();")
            return
        raise NotImplementedError(
            f"torch_cppwrap: output {name} of {parent} was not produced by its kernel call"
        )


# Namespaces of the ops that communicate: functional collectives and their
# wait_tensor, DTensor's all-to-all, symmetric-memory collectives.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem"}
)


def _is_collective(op: Any) -> TypeGuard[torch._ops.OpOverload]:
    return (
        isinstance(op, torch._ops.OpOverload) and op.namespace in COLLECTIVE_NAMESPACES
    )


# Activation checkpointing's wrappers of a recomputed random op.
_RNG_STATE_WRAPPERS = (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state)


def _refuse_higher_order_fallbacks(operations: Sequence[Any]) -> None:
    """Refuses, before any codegen, the higher-order ops Inductor leaves as
    fallback kernels that ours does not run: all but activation
    checkpointing's RNG-state wrappers (``torch._higher_order_ops.print``,
    for one), and ``run_and_save_rng_state`` around a random op without tensor
    arguments (``torch.randn(n)`` recomputed by a checkpoint).  Inductor
    exports such a node for every C++ wrapper before the wrapper sees it, and
    that export asserts on a node without tensor arguments; refused here, the
    graph keeps the Python wrapper as a known gap, not an unexpected error.
    (The backward's run_with_rng_state always has a tensor argument: the
    saved state.)"""
    for operation in operations_with_subgraphs(operations):
        if not isinstance(operation, ir.FallbackKernel):
            continue
        op = operation.op_overload
        if not isinstance(op, torch._ops.HigherOrderOperator):
            continue
        if op not in _RNG_STATE_WRAPPERS:
            raise NotImplementedError(
                f"torch_cppwrap: {operation.python_kernel_name} is not supported "
                "by the C++ wrapper"
            )
        if op is rng_prims.run_and_save_rng_state and not operation.inputs:
            args, _ = operation.unflatten_args(
                operation.inputs, operation.constant_args
            )
            raise NotImplementedError(
                f"torch_cppwrap: {operation.python_kernel_name} around {args[0]}, "
                "a random op without tensor arguments, cannot be exported for "
                "a C++ wrapper"
            )


def operations_with_subgraphs(operations: Sequence[Any]) -> Iterator[Any]:
    """`operations` and those of the subgraphs they hold (torch.cond's
    branches, a while_loop's condition and body, a nested compile region),
    each subgraph once."""
    seen: set[int] = set()

    def walk(operations: Sequence[Any]) -> Iterator[Any]:
        for operation in operations:
            yield operation
            for value in vars(operation).values():
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    if (
                        isinstance(item, ir.Subgraph)
                        and item.graph is not None
                        and id(item.graph) not in seen
                    ):
                        seen.add(id(item.graph))
                        yield from walk(item.graph.operations)

    return walk(operations)


def _schema_values(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[Any]:
    """`op`'s arguments in schema order: those given, then its defaults."""
    arguments = op._schema.arguments
    return [
        *args,
        *(kwargs.get(arg.name, arg.default_value) for arg in arguments[len(args) :]),
    ]


def _device_of(values: Sequence[Any]) -> torch.device | None:
    """The device of an op's first tensor argument, else its device
    argument, as torch._prims.rng_prims picks a generator."""
    for value in values:
        if isinstance(value, ir.IRNode) and (device := value.get_device()):
            return device
    return next((v for v in values if isinstance(v, torch.device)), None)


def _op_from_python_name(name: str) -> torch._ops.OpOverload:
    """torch.ops.aten.scatter_.value -> the OpOverload object."""
    parts = name.split(".")
    if parts[0] == "torch":
        parts = parts[1:]
    if parts[0] == "ops":
        parts = parts[1:]
    if len(parts) == 2:
        parts.append("default")
    namespace, op_name, overload = parts[-3:]
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
