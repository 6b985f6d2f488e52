"""torch_cppwrap's C++ wrapper codegen for CUDA graphs.

:class:`CppWrapperGpu` is :class:`CppWrapperCpu` plus what CUDA needs: Triton
kernels compiled to cubins while the graph compiles, embedded in the wrapper
module and launched through the CUDA driver API on PyTorch's current stream;
extern kernels (cuBLAS, cuDNN) through the ``aoti_torch_cuda_*`` C shim; a
device guard, so a graph on ``cuda:1`` runs there.

One codegen pass.  While the body is generated, every Triton kernel call site
is written twice: as a C++ call of the kernel's launcher,
``launch_<kernel>(device, stream, args...)``, and as a line of the Python
tuning block that Inductor's ``PythonWrapperCodegen`` builds when
``config.triton.autotune_at_compile_time`` is set (ours sets it for every
JIT graph: ``graph.tune_at_compile_time``).
The wrapper only declares each launcher, from its call's argument kinds, so
it is final when the body is done: it starts compiling then
(``codecache.start_wrapper_build``) while the tuning block runs each kernel
once on example inputs, which settles its config.  The tuned config's cubin,
entry name, shared memory, warps and parameter list then become the
launcher's definition (``launcher_src``, one literal each), which the code
cache compiles in a few translation units side by side and links with the
wrapper's object.  Nothing is generated twice, and no Python runs per call.

What a generated launcher looks like::

    CPPWRAP_CUDA_EMBED_CUBIN(cubin_triton_poi_fused_add_0, "/.../3f2a....cubin");
    static cppwrap::cuda::Kernel triton_poi_fused_add_0_kernel(
        cubin_triton_poi_fused_add_0, "triton_poi_fused_add_0", 0, 128);

    CPPWRAP_CUDA_LAUNCHER void launch_triton_poi_fused_add_0(int32_t device, void* stream,
            const cppwrap::Tensor& in_ptr0, ..., int64_t xnumel) {
        const uint32_t grid_x = ((xnumel + (1024 - 1)) / (1024));
        ...
        void* params[] = {&in_ptr0_arg, ..., &xnumel_arg, &global_scratch, &profile_scratch};
        triton_poi_fused_add_0_kernel.launch(device, grid_x, grid_y, grid_z, params, stream);
    }

``torch_cppwrap.patch()`` registers it for ``cuda`` (see ``_patching.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sympy
import torch
from torch._dynamo.utils import counters, dynamo_timed
from torch._inductor import config, ir
from torch._inductor.codegen.common import IndentedBuffer
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SymbolicCallArg
from torch._inductor.virtualized import V
from torch.fx.operator_schemas import normalize_function
from torch.utils._ordered_set import OrderedSet

from torch_cppwrap import _compat
from torch_cppwrap._inductor import codecache
from torch_cppwrap._inductor.codegen import cpp_spellings as spell
from torch_cppwrap._inductor.codegen.cpp_wrapper_cpu import HOST_READ, CppWrapperCpu
from torch_cppwrap._inductor.codegen.shim_catalog import shim_function_exists

log = logging.getLogger(__name__)
# Why a graph is not replayed as one CUDA graph: TORCH_LOGS=perf_hints, as
# upstream says why it skips its CUDA graphs.
perf_hint_log = torch._logging.getArtifactLogger(__name__, "perf_hints")

# ----------------------------------------------------------------------
# C++ spellings for kernel parameters
# ----------------------------------------------------------------------

# Triton signature type of a scalar parameter -> the C type the cubin takes.
TRITON_SCALAR_CTYPE: dict[str, str] = {
    "i1": "int8_t",
    "i8": "int8_t",
    "i16": "int16_t",
    "i32": "int32_t",
    "i64": "int64_t",
    "u1": "uint8_t",
    "u8": "uint8_t",
    "u16": "uint16_t",
    "u32": "uint32_t",
    "u64": "uint64_t",
    "fp32": "float",
    "f32": "float",
    "fp64": "double",
}

# How the wrapper hands a call argument to a launcher, by kind.
LAUNCHER_PARAM_CTYPE: dict[str, str] = {
    "tensor": "const cppwrap::Tensor&",
    "int": "int64_t",
    "float": "double",
    "bool": "bool",
}


# ----------------------------------------------------------------------
# what a tuned Triton kernel needs to be launched from C++
# ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelParam:
    """One parameter of the compiled kernel: a name of the launcher's
    arguments and its Triton signature type ('*fp32', 'i32', ...)."""

    name: str
    signature: str

    @property
    def is_pointer(self) -> bool:
        return self.signature.startswith("*")


@dataclasses.dataclass(frozen=True)
class TunedKernel:
    """A Triton kernel after tuning: the chosen config compiled to a cubin."""

    name: str  # Inductor's name for the kernel (also the C++ names' stem)
    entry: str  # the cubin's entry point (Triton's mangled name)
    cubin_path: str
    shared_bytes: int
    num_warps: int
    # Names the launcher receives, in Inductor's call order.
    launcher_args: tuple[str, ...]
    # The cubin's parameters, in order, before the scratch pointers.
    params: tuple[KernelParam, ...]
    # Grid: C++ statements, then the three dimensions as C++ expressions of
    # the launcher's arguments.
    grid_prefix: tuple[str, ...]
    grid: tuple[str, str, str]
    # Per-program bytes of Triton's scratch buffers; None when the kernel
    # takes no such parameter.
    global_scratch: int | None
    profile_scratch: int | None
    description: str = ""


@dataclasses.dataclass
class LaunchSignature:
    """How the wrapper calls one kernel's launcher: the kind of each argument
    ('tensor', 'int', 'float', 'bool'), fixed by the first call site."""

    kernel_name: str
    kinds: tuple[str, ...]
    metadata: str = ""


def store_cubin(data: bytes) -> Path:
    """Writes a cubin into the graph cache, named by its content."""
    digest = hashlib.sha256(data).hexdigest()
    path = codecache.cache_root() / "cubin" / digest[:2] / f"{digest}.cubin"
    if not path.exists():
        codecache.write_atomic(str(path), data, make_dirs=True)
    return path


def _compile_result(autotuner: Any, launcher: Any) -> Any:
    """The CompileResult that `launcher` (one of `autotuner`'s) was made from."""
    for result in autotuner.compile_results:
        if result.config is launcher.config:
            return result
    raise RuntimeError(
        f"torch_cppwrap: Triton kernel {autotuner.fn.__name__}: no compiled binary "
        f"for its tuned config {launcher.config}"
    )


def _launcher_with_binary(autotuner: Any, launcher: Any) -> Any:
    """`launcher`, or one made again from the same compiled binary that keeps
    it (``launcher.bin``) with its argument lists, as Triton launchers do when
    ``store_cubin`` is set.  Triton's own launcher is built already, so this
    costs no compile."""
    if getattr(launcher, "bin", None) is not None:
        return launcher
    result = copy.copy(_compile_result(autotuner, launcher))
    result.inductor_meta = {**result.inductor_meta, "store_cubin": True}
    return result.make_launcher()


def tuned_kernel_from_autotuner(name: str, autotuner: Any) -> TunedKernel:
    """Reads the tuned config of Inductor's CachingAutotuner for `name`, which
    the tuning block ran once.  That run launched it through Inductor's static
    CUDA launcher where it could (no launcher built with a C compiler), else
    through Triton's."""
    launchers = getattr(autotuner, "launchers", None)
    if not launchers:
        raise RuntimeError(f"torch_cppwrap: Triton kernel {name} was never compiled")
    if len(launchers) != 1:
        raise RuntimeError(
            f"torch_cppwrap: Triton kernel {name} still has {len(launchers)} configs "
            "after tuning"
        )
    if getattr(launchers[0], "_is_static", False):
        return _tuned_static_kernel(name, autotuner, launchers[0])
    launcher = _launcher_with_binary(autotuner, launchers[0])
    binary = launcher.bin
    meta = binary.metadata
    num_ctas = getattr(meta, "num_ctas", 1)
    if (
        num_ctas != 1
        or getattr(meta, "launch_pdl", False)
        or getattr(meta, "launch_cooperative_grid", False)
    ):
        raise NotImplementedError(
            f"torch_cppwrap: Triton kernel {name} needs a cluster, PDL or cooperative "
            "launch, which the C++ wrapper does not do yet"
        )
    return _tuned_kernel(
        name,
        autotuner,
        launcher.config,
        entry=meta.name,
        cubin_path=store_cubin(binary.asm["cubin"]),
        shared_bytes=int(meta.shared),
        num_warps=int(meta.num_warps),
        def_args=launcher.def_args,
        call_args=launcher.call_args,
        global_scratch=getattr(launcher, "global_scratch", None),
        profile_scratch=getattr(launcher, "profile_scratch", None),
        num_stages=getattr(meta, "num_stages", "?"),
    )


def _tuned_static_kernel(name: str, autotuner: Any, launcher: Any) -> TunedKernel:
    """A kernel that Inductor's static CUDA launcher ran: the cubin is the one
    the compile left in Triton's cache, and the static launcher takes it with
    its constants stripped, as the cubin's parameters are."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from torch._inductor.runtime.triton_heuristics import config_to_dict

    result = _compile_result(autotuner, launcher)
    kernel = result.kernel
    _, def_args, none_args = result._get_arg_lists(
        kernel.arg_names, kernel.declared_constexprs
    )
    # Triton releases that take every constexpr at launch (3.3 on) list the
    # config's among the launcher's arguments; the call sites pass none.
    tuned = config_to_dict(launcher.config)
    def_args = [arg for arg in def_args if arg not in tuned]
    call_args = [
        arg
        for i, arg in enumerate(kernel.arg_names)
        if i not in kernel.full_constexprs and arg not in none_args
    ]
    device = result.compile_meta.get("device") or 0
    cubin = Path(triton_cache_dir(device), launcher.cache_hash, f"{kernel.name}.cubin")
    if not cubin.is_file():
        raise RuntimeError(
            f"torch_cppwrap: Triton kernel {name}: its cubin is not at {cubin}, where "
            "the compile left it"
        )
    return _tuned_kernel(
        name,
        autotuner,
        launcher.config,
        entry=kernel.name,
        cubin_path=store_cubin(cubin.read_bytes()),
        shared_bytes=int(kernel.shared),
        num_warps=int(kernel.num_warps),
        def_args=def_args,
        call_args=call_args,
        # The static launcher refuses kernels that need scratch memory, and
        # passes a null pointer where one takes the parameter.
        global_scratch=0 if kernel.has_global_scratch else None,
        profile_scratch=0 if kernel.has_profile_scratch else None,
        num_stages=getattr(launcher.config, "num_stages", "?"),
    )


def _tuned_kernel(
    name: str,
    autotuner: Any,
    tuned_config: Any,
    *,
    entry: str,
    cubin_path: Path,
    shared_bytes: int,
    num_warps: int,
    def_args: Sequence[str],
    call_args: Sequence[str],
    global_scratch: int | None,
    profile_scratch: int | None,
    num_stages: object,
) -> TunedKernel:
    from torch._inductor.runtime.triton_heuristics import GridExpr

    triton_meta = autotuner.triton_meta
    signature: dict[str, str] = triton_meta["signature"]
    constants = triton_meta.get("constants", {})
    params = tuple(
        KernelParam(arg, signature[arg])
        for arg in call_args
        if signature.get(arg, "constexpr") != "constexpr" and arg not in constants
    )
    grid = GridExpr.from_meta(autotuner.inductor_meta, tuned_config, mode="cpp")
    config_text = ", ".join(f"{k}={v}" for k, v in tuned_config.kwargs.items())
    return TunedKernel(
        name=name,
        entry=entry,
        cubin_path=str(cubin_path),
        shared_bytes=shared_bytes,
        num_warps=num_warps,
        launcher_args=tuple(def_args),
        params=params,
        grid_prefix=tuple(grid.prefix),
        grid=(str(grid.x_grid), str(grid.y_grid), str(grid.z_grid)),
        global_scratch=global_scratch,
        profile_scratch=profile_scratch,
        description=(
            f"{config_text}{', ' if config_text else ''}num_warps={num_warps}, "
            f"num_stages={num_stages}, shared memory {shared_bytes} B"
        ),
    )


def _free_symbols(exprs: Sequence[Any]) -> set[sympy.Symbol]:
    return set().union(*(getattr(e, "free_symbols", ()) for e in exprs))


def _layout_symbols(node: Any) -> set[sympy.Symbol]:
    """The symbols in an IR node's sizes and strides."""
    return _free_symbols([*node.get_size(), *node.get_stride()])


# The arguments by which attention's backward takes its forward's dropout
# RNG state (philox seed and offset).
RNG_STATE_ARGUMENTS = ("philox_seed", "philox_offset")


def _takes_rng_state(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        arg.name in RNG_STATE_ARGUMENTS for arg in schema.arguments
    )


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether an FX node draws random numbers (which a replayed CUDA graph
    repeats unless the generator's offset is advanced before it)."""
    target = node.target
    name = str(getattr(target, "__name__", target))
    seeded = torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
    if not seeded and not any(
        word in name for word in ("rand", "seed", "bernoulli", "dropout")
    ):
        return False
    # Attention's backward is tagged as seeded too, but redraws its forward's
    # mask from the RNG state it is given, not from the generator.
    if _takes_rng_state(target):
        return False
    # Attention kernels are tagged as seeded for their dropout; with none (as
    # in eval) they draw nothing and capture like any other kernel.
    if not callable(target):
        return True
    normalized = normalize_function(
        target, node.args, node.kwargs, normalize_to_only_use_kwargs=True
    )
    if normalized is None or "dropout_p" not in normalized.kwargs:
        return True
    dropout = normalized.kwargs["dropout_p"]
    return not (isinstance(dropout, (int, float)) and dropout == 0)


# ----------------------------------------------------------------------
# rendering a launcher
# ----------------------------------------------------------------------


def _kernel_param_value(param: KernelParam, kind: str) -> tuple[str, str]:
    """(declaration, variable) handing launcher argument `param.name`, of
    wrapper kind `kind`, to the cubin."""
    var = f"{param.name}_arg"
    if param.is_pointer:
        if kind != "tensor":
            raise NotImplementedError(
                f"torch_cppwrap: pointer parameter {param.name} given a {kind}"
            )
        return f"void* {var} = {param.name}.data_ptr();", var
    ctype = TRITON_SCALAR_CTYPE.get(param.signature)
    if ctype is None:
        raise NotImplementedError(
            f"torch_cppwrap: Triton parameter {param.name} of type {param.signature} "
            "is not supported by the C++ wrapper"
        )
    if kind == "tensor":
        raise NotImplementedError(
            f"torch_cppwrap: scalar parameter {param.name} given a tensor"
        )
    return f"{ctype} {var} = static_cast<{ctype}>({param.name});", var


def _comment_text(text: str) -> str:
    """`text` as a one-line C++ comment that can neither close the generated
    module's raw string nor continue onto the next line."""
    return "// " + text.replace("'''", "' ' '").rstrip().rstrip("\\")


def launcher_prototype(
    name: str, call: LaunchSignature, arg_names: Sequence[str] | None = None
) -> str:
    """The launcher's C++ prototype: the wrapper declares it (without names),
    the launchers' translation unit defines it.  Hidden, so that it does not
    leave the graph's module."""
    ctypes = [LAUNCHER_PARAM_CTYPE[kind] for kind in call.kinds]
    if arg_names is None:
        params = ["int32_t", "void*", *ctypes]
    else:
        params = ["int32_t device", "void* stream"] + [
            f"{ctype} {name}" for ctype, name in zip(ctypes, arg_names, strict=True)
        ]
    return f"CPPWRAP_CUDA_LAUNCHER void launch_{name}({', '.join(params)})"


def render_launcher(kernel: TunedKernel, call: LaunchSignature) -> str:
    """The C++ that embeds `kernel`'s cubin and defines its launcher."""
    if len(call.kinds) != len(kernel.launcher_args):
        raise NotImplementedError(
            f"torch_cppwrap: Triton kernel {kernel.name} is called with "
            f"{len(call.kinds)} arguments but its launcher takes "
            f"{list(kernel.launcher_args)}"
        )
    kinds = dict(zip(kernel.launcher_args, call.kinds, strict=True))
    cubin_symbol = f"cubin_{kernel.name}"
    kernel_var = f"{kernel.name}_kernel"
    code = IndentedBuffer()
    for line in call.metadata.splitlines():
        if line.strip():
            code.writeline(_comment_text(line.strip().lstrip("#/ ")))
    code.writeline(f"// {kernel.name}: {kernel.description}")
    code.writeline(
        f"CPPWRAP_CUDA_EMBED_CUBIN({cubin_symbol}, {spell.string_literal(kernel.cubin_path)});"
    )
    code.writeline(
        f"static cppwrap::cuda::Kernel {kernel_var}({cubin_symbol}, "
        f"{spell.string_literal(kernel.entry)}, {kernel.shared_bytes}, {32 * kernel.num_warps});"
    )
    code.writeline(f"{launcher_prototype(kernel.name, call, kernel.launcher_args)} {{")
    with code.indent():
        for line in kernel.grid_prefix:
            code.writeline(line)
        for axis, expr in zip("xyz", kernel.grid, strict=True):
            code.writeline(f"const uint32_t grid_{axis} = {expr};")
        code.writeline("if (grid_x == 0 || grid_y == 0 || grid_z == 0) return;")
        pointers = []
        for param in kernel.params:
            decl, var = _kernel_param_value(param, kinds.get(param.name, "int"))
            code.writeline(decl)
            pointers.append(f"&{var}")
        for scratch, size in (
            ("global_scratch", kernel.global_scratch),
            ("profile_scratch", kernel.profile_scratch),
        ):
            if size is None:
                continue
            if size > 0:
                code.writeline(
                    f"cppwrap::Tensor {scratch}_buffer = cppwrap::cuda::scratch(device, "
                    f"uint64_t(grid_x) * grid_y * grid_z, {size});"
                )
                code.writeline(f"void* {scratch} = {scratch}_buffer.data_ptr();")
            else:
                code.writeline(f"void* {scratch} = nullptr;")
            pointers.append(f"&{scratch}")
        code.writeline(f"void* params[] = {{{', '.join(pointers)}}};")
        code.writeline(
            f"{kernel_var}.launch(device, grid_x, grid_y, grid_z, params, stream);"
        )
    code.writeline("}")
    return code.getvalue()


# ----------------------------------------------------------------------
# the wrapper codegen
# ----------------------------------------------------------------------


class CppWrapperGpu(CppWrapperCpu):
    """Generates a CUDA graph's host wrapper as C++."""

    device = "cuda"

    def __init__(self) -> None:
        self.launch_signatures: dict[str, LaunchSignature] = {}
        self.kernel_metadata: dict[str, str] = {}
        # Kernel sizes declared, by name and graph: each subgraph's code is a
        # C++ block of its own, where a name the parent declared may be
        # declared again and none a sibling block declared is seen.
        self.symbolic_call_args: set[tuple[str, Any]] = set()
        super().__init__()

    # ------------------------------------------------------------------
    # sections
    # ------------------------------------------------------------------

    header_comment = (
        "// Host wrapper generated by torch_cppwrap: `call` unpacks the inputs,\n"
        "// launches the graph's kernels on the current CUDA stream with the GIL\n"
        "// released, and returns its outputs."
    )
    uses_triton_tuning = True

    def codegen_input_nan_asserts(self) -> None:
        # Inductor's Triton codegen then writes upstream's C++ check after
        # each kernel, which ours does not compile.
        raise NotImplementedError(
            "torch_cppwrap: config.nan_asserts is not supported by the CUDA C++ "
            "wrapper yet"
        )

    def codegen_alloc_from_pool(self, *args: Any, **kwargs: Any) -> Any:
        # The CPU wrapper's pools have not run on a GPU, under CUDA-graph
        # replay least of all.
        raise NotImplementedError(
            "torch_cppwrap: config.memory_planning is not supported by the CUDA C++ "
            "wrapper yet"
        )

    def generate_start_graph(self) -> None:
        raise NotImplementedError(
            "torch_cppwrap: config.profile_bandwidth measures Triton kernels "
            "through their Python launchers, which the CUDA C++ wrapper does not use"
        )

    @classmethod
    def debug_sync_line(cls) -> str:
        raise NotImplementedError(
            "torch_cppwrap: the CUDA C++ wrapper does not synchronise for "
            "triton.debug_sync_graph or triton.debug_sync_kernel yet"
        )

    # ------------------------------------------------------------------
    # replaying the whole graph as one CUDA graph (cppwrap::cuda::GraphReplay)
    # ------------------------------------------------------------------

    # Fewer launches than this gain nothing from a replay: its copies (the
    # inputs in, outputs still held out of the pool) cost about a launch.
    min_launches_for_cuda_graph = 3

    @functools.cached_property
    def cuda_graph_blocker(self) -> str | None:
        """Why this graph cannot be replayed as one CUDA graph, or None when
        it can.  Asked once the body is generated."""
        if config.triton.cudagraphs:
            return "Inductor's own CUDA graphs (mode='reduce-overhead') wrap it"
        if self.collective_ops:
            # A collective is issued and waited for on the host (c10d's work
            # registry), and every rank must take part; a replay would skip both.
            return f"the graph runs collectives ({self.collective_ops[0]})"
        # None outputs (gradients of inputs that need none) stay None.
        if any(k not in ("tensor", "none") for k in self.output_kinds):
            return "an output is not a tensor"
        if "tensor" not in self.output_kinds:
            return "no output is a tensor"
        if V.graph.device_types - {"cuda"}:
            return "not every tensor is on the GPU"
        inputs = self.get_graph_inputs()
        # The symbols the inputs bind: a graph is captured once per set of
        # their values (GraphReplays).  A buffer sized by any other symbol
        # has a size only known once the graph has run.
        bound: set[sympy.Symbol] = set()
        for name in self.get_graph_input_names():
            value = inputs.get(name)  # None: an unused slot (write_prefix)
            if isinstance(value, sympy.Expr):
                if not value.is_integer:
                    return f"input {name} is a float"
                bound |= value.free_symbols
                continue
            if not isinstance(value, ir.IRNode) or name in self.input_objects:
                return f"input {name} is not a tensor"
            device = value.get_device()
            if device is None or device.type != "cuda":
                return f"input {name} is not a CUDA tensor"
            try:
                bound |= _layout_symbols(value)
            except (AttributeError, NotImplementedError, AssertionError):
                return f"input {name} has no fixed layout"
        for buffer in V.graph.buffers:
            try:
                layout = buffer.get_layout()
                shape = [*layout.size, *layout.stride]
            except (AttributeError, NotImplementedError, AssertionError):
                continue
            if _free_symbols(shape) - bound:
                return f"buffer {buffer.get_name()} has a data-dependent shape"
        if V.graph.mutated_inputs & OrderedSet(self.get_graph_input_names()):
            return "the graph mutates an input"
        for node in self._random_nodes:
            # A replay advances the default CUDA generator only.
            if node.kwargs.get("generator") is not None:
                return f"the graph draws from a generator it is given ({node.target})"
        if self.replay_blockers:
            return self.replay_blockers[0]
        launches = sum(device == self.device for device, _ in self.launches)
        if launches < self.min_launches_for_cuda_graph:
            return f"only {launches} launch(es)"
        return None

    @functools.cached_property
    def _random_nodes(self) -> list[torch.fx.Node]:
        return [
            node
            for node in V.graph.graph.nodes
            if node.op == "call_function" and _draws_random_numbers(node)
        ]

    @property
    def draws_random_numbers(self) -> bool:
        """Whether the graph draws from the CUDA generator: its replays go
        through torch.cuda.CUDAGraph.replay, which advances the generator."""
        return bool(self._random_nodes)

    @functools.cached_property
    def rng_state_inputs(self) -> list[str]:
        """The graph inputs that an op takes as attention's dropout RNG state
        (philox seed and offset, from the forward): CUDA tensors when the
        forward was replayed, which the op reads on the host unless it runs
        under capture (cppwrap::cuda::host_rng_state)."""
        inputs = set(self.get_graph_input_names())
        names: list[str] = []
        for node in V.graph.graph.nodes:
            if node.op != "call_function" or not isinstance(
                node.target, torch._ops.OpOverload
            ):
                continue
            for index, arg in enumerate(node.target._schema.arguments):
                if arg.name not in RNG_STATE_ARGUMENTS:
                    continue
                value = (
                    node.args[index]
                    if index < len(node.args)
                    else node.kwargs.get(arg.name)
                )
                if (
                    isinstance(value, torch.fx.Node)
                    and value.op == "placeholder"
                    and value.target in inputs
                    and value.target not in names
                ):
                    names.append(str(value.target))
        return names

    def body_prologue(self) -> list[str]:
        if not self.rng_state_inputs:
            return []
        return [
            "// Attention's RNG state, on the host unless captured (see host_rng_state).",
            *(
                f"cppwrap::cuda::host_rng_state({name});"
                for name in self.rng_state_inputs
            ),
        ]

    def _tensor_outputs(self) -> list[int]:
        """The outputs a replay makes (the others are None)."""
        return [i for i, kind in enumerate(self.output_kinds) if kind == "tensor"]

    def body_opening(self) -> list[str]:
        if self.cuda_graph_blocker is not None:
            return []
        graph_inputs = self.get_graph_inputs()
        inputs = ", ".join(
            "nullptr" if isinstance(graph_inputs[name], sympy.Expr) else f"&{name}"
            for name in self.get_graph_input_names()
        )
        outputs = ", ".join(f"&out{i}" for i in self._tensor_outputs())
        return [
            f"const cppwrap::Tensor* const graph_inputs[] = {{{inputs}}};",
            f"cppwrap::Tensor* const graph_outputs[] = {{{outputs}}};",
            "const auto replayed = cuda_graph != nullptr",
            "    ? cuda_graph->replay(graph_inputs, graph_outputs)",
            "    : cppwrap::cuda::GraphReplay::kSkipped;",
            "if (replayed != cppwrap::cuda::GraphReplay::kReplayed) {",
            "    if (replayed == cppwrap::cuda::GraphReplay::kMissed) "
            "cuda_graph->observe(graph_inputs);",
        ]

    # Graphs captured at most for one module: one per set of sizes (a graph
    # compiled for dynamic shapes) and per set of parameters (graphs of the
    # same code share the module); later ones run kernel by kernel.  As many
    # as cudagraph trees record before they warn.
    max_cuda_graphs = 8

    def cuda_graph_key_inputs(self) -> list[int]:
        """The positions of the inputs whose values (ints) or sizes and
        strides (tensors) tell the graphs of a dynamic-shape graph apart."""
        inputs = self.get_graph_inputs()
        keys = []
        for index, name in enumerate(self.get_graph_input_names()):
            value = inputs[name]
            symbols = (
                value.free_symbols
                if isinstance(value, sympy.Expr)
                else _layout_symbols(value)
            )
            if symbols:
                keys.append(index)
        return keys

    def call_opening(self) -> list[str]:
        if self.cuda_graph_blocker is not None:
            perf_hint_log.info(
                "torch_cppwrap: graph %s launches its kernels one by one, not as "
                "a CUDA graph: %s",
                V.graph.graph_id,
                self.cuda_graph_blocker,
            )
            counters["inductor"]["cppwrap_cuda_graph_skips"] += 1
            return super().call_opening()
        n_inputs = len(self.get_graph_input_names())
        keys = self.cuda_graph_key_inputs()
        lines = [
            "// Warmed up on the first call, captured on the second and replayed as",
            "// one CUDA graph from the third on; see GraphReplay.",
        ]
        if self.draws_random_numbers:
            targets = sorted({str(node.target) for node in self._random_nodes})
            lines.append(
                f"// It draws random numbers ({', '.join(targets)}): each replay "
                "advances the CUDA generator."
            )
        if keys:
            lines += [
                f"// One graph per set of sizes of inputs {keys} "
                f"({self.max_cuda_graphs} graphs at most).",
            ]
        return [
            *lines,
            "// Each module (each load of this library) replays its own graphs.",
            "static cppwrap::cuda::GraphReplays* make_cuda_graphs() {",
            f"    return new cppwrap::cuda::GraphReplays({n_inputs}, "
            f"{len(self._tensor_outputs())}, {{{', '.join(map(str, keys))}}}, "
            f"{self.max_cuda_graphs}, "
            f"/*draws_random=*/{'true' if self.draws_random_numbers else 'false'});",
            "}",
            "",
            "static PyObject* run(PyObject* graph_module, PyObject* args, bool replayable);",
            "",
            "// The kernels one by one, never a replay: what a warm-up or capture runs.",
            "static PyObject* run_kernels(PyObject* graph_module, PyObject* args) {",
            "    return run(graph_module, args, false);",
            "}",
            "",
            "static PyObject* run(PyObject* graph_module, PyObject* args, bool replayable) {",
            "    cppwrap::cuda::GraphReplay* const cuda_graph = replayable",
            "        ? cppwrap::cuda::graph_replays(graph_module).select(args)",
            "        : nullptr;",
            "    if (cuda_graph != nullptr && cuda_graph->should_prepare()) {",
            "        PyObject* outputs = cuda_graph->prepare(graph_module, args, run_kernels);",
            "        if (outputs != Py_None) return outputs;",
            "        Py_DECREF(outputs);",
            "    }",
        ]

    def module_definition(self) -> list[str]:
        if self.cuda_graph_blocker is not None:
            return super().module_definition()
        return [
            "static PyObject* call_impl(PyObject* graph_module, PyObject* args) {",
            "    return run(graph_module, args, true);",
            "}",
            "",
            'CPPWRAP_CUDA_DEFINE_GRAPH_MODULE("Inductor graph compiled by torch_cppwrap", '
            "make_cuda_graphs)",
        ]

    def write_get_raw_stream(self, device_idx: int, graph_name: str) -> str:
        # Memoised per (device, graph) by PythonWrapperCodegen.__init__.
        name = f"stream{device_idx}"
        self.writeline(f"void* {name} = cppwrap::cuda::current_stream({device_idx});")
        return name

    def codegen_device_guard_enter(
        self, device_idx: int, *args: Any, **kwargs: Any
    ) -> None:
        if self.last_seen_device_guard_index is None:
            self.writeline(f"cppwrap::cuda::DeviceGuard device_guard({device_idx});")
        elif self.last_seen_device_guard_index != device_idx:
            self.writeline(f"device_guard.set_index({device_idx});")
        self.last_seen_device_guard_index = device_idx

    def codegen_device_guard_exit(self) -> None:
        pass  # the guard lives until call_impl returns

    def _generate_symbolic_call_arg_helper(
        self, arg: SymbolicCallArg, graph: Any, in_profile_scope: bool = False
    ) -> None:
        # in_profile_scope (torch 2.15): the line lies inside a kernel
        # profiling block; this wrapper opens none.
        name = str(arg.inner)
        value = self.codegen_cpp_sizevar(arg.inner_expr)
        if (name, graph) in self.symbolic_call_args:
            self.writeline(f"{name} = {value};")
        else:
            self.symbolic_call_args.add((name, graph))
            self.writeline(f"int64_t {name} = {value};")

    # ------------------------------------------------------------------
    # Triton kernels
    # ------------------------------------------------------------------

    @staticmethod
    def _require_compile_time_tuning() -> None:
        if not config.triton.autotune_at_compile_time:
            raise NotImplementedError(
                "torch_cppwrap: the CUDA C++ wrapper tunes Triton kernels while the "
                "graph compiles, which needs config.triton.autotune_at_compile_time "
                "(torch.compile's cpp_wrapper settings set it for JIT graphs)"
            )

    def _define_kernel_helper(
        self,
        kernel_name: str,
        kernel_body: str,
        metadata: str | None = None,
        gpu: bool = True,
        cpp_definition: str | None = None,
    ) -> None:
        if not gpu:
            super()._define_kernel_helper(
                kernel_name, kernel_body, metadata, gpu, cpp_definition
            )
            return
        self._require_compile_time_tuning()
        self.kernel_metadata[kernel_name] = metadata or ""
        # Into the tuning block, which compiles and tunes it.
        PythonWrapperCodegen._define_kernel_helper(
            self, kernel_name, kernel_body, metadata, gpu, cpp_definition
        )

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
        device = device or V.graph.get_current_device_or_throw()
        if device.type == "cpu":
            super()._generate_kernel_call_helper(
                kernel_name,
                call_args,
                device=device,
                triton=triton,
                arg_types=arg_types,
                **kwargs,
            )
            return
        if not triton:
            raise NotImplementedError(
                f"torch_cppwrap: CUDA C++ kernel {kernel_name} (CUTLASS or a CUDA "
                "template) is not supported by the C++ wrapper"
            )
        if kernel_name.startswith("multi_kernel_"):
            raise NotImplementedError(
                "torch_cppwrap: config.triton.multi_kernel is not supported by the C++ wrapper"
            )
        self._require_compile_time_tuning()
        assert arg_types is not None and len(arg_types) == len(call_args)
        if kernel_name not in self.kernel_autotune_names:
            # The tuning block's line for this kernel (once per kernel). Its
            # example sizes are the hints of the graph the call is in: a
            # subgraph's precomputed sizes (`ps0`) are its own, not the
            # parent's, which is V.graph while the lines are emitted.
            with V.set_graph_handler(self.get_codegened_graph()):
                PythonWrapperCodegen._generate_kernel_call_helper(
                    self,
                    kernel_name,
                    call_args,
                    device=device,
                    triton=True,
                    arg_types=arg_types,
                    **kwargs,
                )
        index = device.index or 0
        stream = self.write_get_raw_stream(index, kwargs.get("graph_name", ""))
        kinds, values = [], []
        for arg, arg_type in zip(call_args, arg_types, strict=True):
            kind, value = self._launch_argument(arg, arg_type)
            kinds.append(kind)
            values.append(value)
        signature = LaunchSignature(
            kernel_name, tuple(kinds), self.kernel_metadata.get(kernel_name, "")
        )
        known = self.launch_signatures.setdefault(kernel_name, signature)
        if known.kinds != signature.kinds:
            raise NotImplementedError(
                f"torch_cppwrap: Triton kernel {kernel_name} is called with different "
                f"argument kinds ({known.kinds} and {signature.kinds})"
            )
        self.launches.append((device.type, kernel_name))
        self.write_kernel_line(
            kernel_name,
            f"launch_{kernel_name}({', '.join([str(index), stream, *values])});",
        )

    def _launch_argument(self, arg: Any, arg_type: Any) -> tuple[str, str]:
        """(kind, C++ expression) of one Triton call argument."""
        from torch._inductor.codegen.triton_utils import should_unwrap_unspec_arg

        if isinstance(arg, SymbolicCallArg):
            return "int", str(arg.inner)
        if isinstance(arg, bool):
            return "bool", spell.bool_literal(arg)
        if isinstance(arg, int):
            return "int", spell.int_literal(arg)
        if isinstance(arg, float):
            return "float", spell.float_literal(arg)
        if isinstance(arg, sympy.Expr):
            if arg.is_integer is False or isinstance(arg, sympy.Float):
                return "float", self.codegen_cpp_sizevar(arg)
            return "int", self.codegen_cpp_sizevar(arg)
        if isinstance(arg, str):
            if "=" in arg:
                raise NotImplementedError(
                    f"torch_cppwrap: keyword Triton argument {arg} is not supported"
                )
            if isinstance(arg_type, torch.dtype):
                if should_unwrap_unspec_arg(arg):
                    # A Python scalar that dynamo passed as a 0-d CPU tensor.
                    self.replay_blockers.append(HOST_READ)
                    if arg_type.is_floating_point:
                        return "float", f"cppwrap::item_double({arg})"
                    return "int", f"cppwrap::item_long({arg})"
                return "tensor", arg
            return "int", arg
        raise NotImplementedError(
            f"torch_cppwrap: Triton argument {arg!r} ({type(arg).__name__}) is not "
            "supported by the C++ wrapper"
        )

    def get_autotuning_input_name(self, idx: int) -> str:
        return f"_cppwrap_autotune_input_{idx}"

    def generate_and_run_autotune_block(self) -> None:
        """Declares each kernel's launcher.  The tuning block runs later, in
        `define_launchers`: only the launchers' definitions need the configs
        it settles on, so the wrapper, final by then, compiles while it runs."""
        if self.launch_signatures:
            self.header.writeline("")
        for name, signature in self.launch_signatures.items():
            self.header.writeline(f"{launcher_prototype(name, signature)};")

    def generate_end(self, result: IndentedBuffer) -> None:
        # What `result` holds after the module's Python imports is the
        # wrapper's C++ source, complete (the value of `wrapper_src`).
        imports, text = self.imports.getvalue(), result.getvalue()
        early = bool(self.launch_signatures) and text.startswith(imports)
        wrapper_source = text[len(imports) :]
        if early:
            codecache.start_wrapper_build(wrapper_source, self.device)
        try:
            super().generate_end(result)
        except BaseException:
            if early:  # the tuning failed: nothing will take the build
                codecache.take_wrapper_build(wrapper_source, self.device)
            raise
        # Kept in the module, so that a graph loaded from the FX graph cache
        # still says why it is not replayed.
        result.writeline(f"cuda_graph_blocker = {self.cuda_graph_blocker!r}")

    def define_launchers(self) -> list[str]:
        """Runs Inductor's tuning block, then defines each kernel's launcher
        from the config it settled on."""
        if not self.launch_signatures:
            return []
        scope = self._run_tuning_block()
        return [
            render_launcher(tuned_kernel_from_autotuner(name, scope[name]), signature)
            for name, signature in self.launch_signatures.items()
        ]

    def _run_tuning_block(self) -> dict[str, Any]:
        """Runs Inductor's tuning block (each kernel compiled and run once on
        example inputs); returns its namespace, the kernels' autotuners."""
        self.kernel_autotune_defs.splice(
            """
            async_compile.wait(globals())
            del async_compile
            """
        )
        scope: dict[str, Any] = {}
        sample_inputs = getattr(V.graph, "autotuning_inputs", None)
        if sample_inputs:
            scope = {
                self.get_autotuning_input_name(i): v
                for i, v in enumerate(sample_inputs)
            }
        code = (
            self.kernel_autotune_defs.getvalue()
            + "\n"
            + self.kernel_autotune_calls.getvalue()
        )
        log.debug("torch_cppwrap: tuning block:\n%s", code)
        try:
            # Inductor turns its static CUDA launcher off under cpp_wrapper,
            # which upstream's wrapper has no use for.  This block is Python:
            # a kernel it compiles in this process then launches through the
            # static launcher too, as one compiled in a worker does, rather
            # than through a Triton launcher built with the C compiler.
            with (
                config.patch(cpp_wrapper=False),
                dynamo_timed(
                    "CppWrapperGpu.run_tuning_block",
                    log_pt2_compile_event=True,
                ),
            ):
                exec(compile(code, "<torch_cppwrap tuning block>", "exec"), scope)
        except Exception as e:
            raise RuntimeError(
                f"torch_cppwrap: compiling and tuning the graph's Triton kernels failed: {e}"
            ) from e
        return scope

    # ------------------------------------------------------------------
    # extern kernels and fallbacks through the CUDA C shim
    # ------------------------------------------------------------------

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
        if not kernel.startswith("aoti_torch_cuda_"):
            super()._generate_extern_kernel_out_helper(
                kernel, out, out_view, args, device, stack_traces, profiling_args
            )
            return
        if not shim_function_exists(kernel, "cuda"):
            raise NotImplementedError(f"torch_cppwrap: no C shim function {kernel}")
        out_arg = f"{out}.get()"
        if out_view:
            view_name = f"{out}_as_strided"
            self.writeline(f"auto {view_name} = {out_view};")
            out_arg = f"{view_name}.get()"
        self._shim_call(kernel, [out_arg, *args], out, device)

    def generate_fallback_kernel(self, node: Any) -> None:
        op = node.op_overload
        device = d.type if (d := node.get_device()) else self.device
        if device == "cuda" and isinstance(op, torch._ops.OpOverload):
            shim_fn = _compat.c_shim_function_name(op, device)
            if shim_fn is not None and shim_function_exists(shim_fn, "cuda"):
                PythonWrapperCodegen.generate_fallback_kernel(self, node)
                return
        super().generate_fallback_kernel(node)
