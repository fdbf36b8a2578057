"""`--compile`: the model's layers compiled with torch.compile, attention left eager.

What is compiled, and why (measured; BENCHMARKS.md, "Compiled forward"):

- Each layer (the modules of the model's layer list: LLaDA's blocks, Dream's layers) is compiled
  with `nn.Module.compile`, in place: norms, projections, RoPE and the MLP. torch.compile takes a
  module's parameters as graph inputs, so one compilation serves every layer of the stack (a
  32-layer model compiles one layer's graphs); the weights are left as they are: torchao's
  quantized weights (unmask.quantize; LLM compiles after quantizing) stay its tensor subclass,
  and compiled int8 layers give the uncompiled int8 model's tokens (tests/test_compile.py).
- The attention of a call (`Frame.attend`) runs eager, between a layer's two graphs: its Python
  structure depends on the call (packed or padded rows, row groups, stored keys), so traced it
  recompiled at almost every step and, past torch's recompile limit (8 per function), ran
  uncompiled with a warning. Compiling the whole forward instead took 72 s on the 2-layer test
  model, then hit that limit.
- The embedding, the RoPE angles and the LM head (a gather of the scored positions, then one
  product) run eager, once per call.

Shapes: a layer sees (B, T, d_model) inputs, B the call's rows (1 when packed) and T its
token count (its own, or its canonical one) or packed tokens (unmask.engine.runner).
torch.compile's automatic dynamic shapes compile the first call's sizes, then, at the first
call of other sizes, a graph with those sizes symbolic, which serves every later size: with
the specialisations of a size of 1 and of the two layouts attention hands back (packed, padded
rows) that is a handful of compiles per function however many steps, rows and widths follow
(tests/test_compile.py counts them).
`dynamic=True` (every size symbolic from the start, d_model too) gave CPU code 1.2-2.8x slower
than eager on the embedded model.

CUDA graphs (mode reduce-overhead, max-autotune) are refused: they failed on an H200 (below).
On that H200 (torch 2.11, bfloat16, a 140M-parameter LLaDA shape) mode default decoded in
1.09-1.14x eager's time, and float32 tokens equalled eager's for 4 decoders x LLaDA and Dream.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from unmask.errors import InputError
from unmask.kv import Frame

COMPILE_DEVICES = ("cpu", "cuda")
RECOMPILE_LIMIT = 64  # compilations per function before torch runs it uncompiled


def compile_model(model: nn.Module, mode: str = "default") -> None:
    """Compile `model`'s layers in place (on the device and dtype it has now; its state_dict
    keys stay the same). mode: torch.compile's, among those without CUDA graphs ("default",
    "max-autotune-no-cudagraphs"). Call check_compile first for a message that says what is
    missing instead of the compiler's error at the first forward."""
    from torch._inductor import list_mode_options

    modes = {name: bool(options.get("triton.cudagraphs")) for name, options
             in list_mode_options().items()}
    valid = ", ".join(name for name, graphs in modes.items() if not graphs)
    if mode not in modes:
        raise InputError(f"unknown compile mode {mode!r}; valid: {valid}")
    if modes[mode]:
        # On an H200 (torch 2.11) reduce-overhead failed in its first forward (a RuntimeError
        # from the CUDA graph trees' memory pool check) and every request with it: a layer's
        # two graphs hand tensors to and from the eager attention between them.
        raise InputError(f"compile mode {mode!r} records CUDA graphs, which the eager attention "
                         f"between a layer's graphs breaks (unmask.compiling); valid: {valid}")
    layers = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not layers:
        raise InputError(f"{type(model).__name__} has no layer list (nn.ModuleList) to compile")
    _attention_runs_eager()
    import torch._dynamo

    # The compile units are shared by every model in the process (layers.attention by LLaDA
    # and Dream): each model, dtype and layout adds compilations of them (3-4 per function for
    # the first model, measured; the second took attention's to 5), so a process running a few
    # (scripts/gpu_check.py) would pass torch's default limit of 8 per function, past which it
    # runs them uncompiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    for layer in (m for stack in layers for m in stack):
        layer.compile(mode=mode)


def _attention_runs_eager() -> None:
    """Mark Frame.attend as a point where torch.compile stops tracing and runs the call as it is
    (its callees too), once per process. Outside compiled code the mark costs ~1 us a call. Set
    here, not in unmask.kv, because torch.compiler's import costs ~1.5 s that a run without
    --compile does not pay."""
    if not getattr(Frame.attend, "_torchdynamo_disable", False):
        Frame.attend = torch.compiler.disable(
            Frame.attend, reason="unmask: attention runs eager (unmask.compiling)")


def check_compile(device: torch.device) -> None:
    """An InputError (one line: what is missing, what works instead) where torch.compile cannot
    run on `device`: a Python torch.compile does not support, a device other than cpu or cuda,
    no C++ compiler for the CPU code (inductor looks for $CXX, else g++: torch._inductor.config
    .cpp.cxx), no triton or no C compiler for the CUDA kernels."""
    from torch._dynamo import is_dynamo_supported

    instead = "run without --compile"
    if not is_dynamo_supported():
        raise InputError(f"--compile: torch {torch.__version__}'s torch.compile does not support "
                         f"this Python; {instead}")
    if device.type not in COMPILE_DEVICES:
        raise InputError(f"--compile runs on {' or '.join(COMPILE_DEVICES)}, not {device.type}; "
                         f"{instead}")
    if device.type == "cpu" and _cpp_compiler() is None:
        raise InputError(f"--compile on cpu needs a C++ compiler (g++, or the one $CXX names) "
                         f"and none was found; install one (e.g. apt-get install g++) or {instead}")
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise InputError(f"--compile on cuda needs triton, which this torch "
                             f"({torch.__version__}) cannot import; pip install the triton "
                             f"version it pins, or {instead}")
        if _c_compiler() is None:
            raise InputError(f"--compile on cuda needs a C compiler for triton's launcher "
                             f"(gcc, clang, or the one $CC names) and none was found; install "
                             f"one or {instead}")


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU code, or None when its search finds none."""
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return None


def _c_compiler() -> str | None:
    """A C compiler found where triton looks for one ($CC, gcc, clang), or None."""
    for name in (os.environ.get("CC"), "gcc", "clang"):
        found = name and shutil.which(name)
        if found:
            return found
    return None


def recompile_count() -> int:
    """torch.compile's recompilations in this process so far, all compiled code together:
    compilations of a function beyond its first (a guard on a shape, layout or value failed).
    Read from torch._dynamo's per-function compile counter, the count behind the [frame/compile]
    ids of TORCH_LOGS=recompiles."""
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER

    return sum(max(n - 1, 0) for n in FRAME_COMPILE_COUNTER.values())
