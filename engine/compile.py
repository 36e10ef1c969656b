"""``torch.compile`` of the prompt-dependent encoders (``MODEL.COMPILE``).

Compiled: the text encoder, the prompted vision encoder and CLIP's image tower (open_clip's
``VisionTransformer`` / ``ModifiedResNet``, frozen in CoOp-style trainers but run on every
training batch). On a GPU the text encoder of a prompt learner is launch-bound: 100 class
prompts of 16 tokens through ViT-B/16's 12 text blocks are ~540 small kernels forward and
backward. Measured on one H200 (fp16 CLIP, CoOp's prompts, 100 classes, forward + backward of
the text encoder alone): 19 ms eager, 9.6 ms with ``max-autotune-no-cudagraphs``, 3.0 ms with
``reduce-overhead`` (CUDA graphs).

Values:
- ``auto`` (the default): ``reduce-overhead`` for the training steps of a run on a CUDA
  device, off otherwise: on CPU, in evaluation-only runs and in the evaluations of a training
  run, where the encoders run too few times (a test set is a few to a few hundred batches) to
  repay compiling their no-grad graphs. Compilation starts with the first training step
  (:meth:`compile_model` of the trainer), not when the trainer is built, and only when it pays:
  the run's steps win back the compile time, or the persistent cache holds the graphs
  (:mod:`engine.compile_cache`, which also puts inductor's caches in one shareable folder).
- ``""`` / ``off``: eager.
- a ``torch.compile`` mode (``default``, ``reduce-overhead``, ``max-autotune``,
  ``max-autotune-no-cudagraphs``) or a backend for debugging (``eager``, ``aot_eager``):
  compiled from the trainer's construction on, evaluation-only runs included.

What a compiled encoder does (:class:`CompiledForward`, which replaces the module's ``forward``):
- Static shapes: one graph per input signature (shapes, dtypes, grad mode, autocast). Batches
  smaller than the configured batch (the last one of an epoch or of a test set) run eagerly
  (:func:`eager`), so they neither trigger a compilation nor capture a CUDA graph of their own.
- The first call of each signature is timed (compilation included; logged), and the first
  :data:`CHECKED_CALLS` calls (CUDA graphs are recorded at the second call and replayed from the
  third) are checked against the eager forward on the same inputs (under ``no_grad``, with the
  random state forked): if the outputs disagree beyond rounding (see :func:`outputs_disagree`),
  or compilation or any later compiled call raises, the module goes back to eager for the rest
  of the process with a warning that names the reason. A compiled step never silently changes
  results.
- Compiled graphs are cached by ``torch._dynamo`` per code object, not per module: a second run
  in the same process (``tools/grid.py`` workers) with the same shapes reuses them without
  compiling again (``tests/test_compile.py`` counts the graphs).
- A text encoder with a memory option on (``MODEL.TEXT_CHUNK`` / ``MODEL.CHECKPOINT_TEXT`` /
  ``MODEL.SHARED_PREFIX``, engine/clip/text.py) is left eager: its forward is a Python loop of
  activation checkpoints, whose recomputation in the backward would replay CUDA graphs outside
  their step, or has shapes that depend on the prompts' values. The image
  encoders are compiled as usual (tests/test_text_memory.py).
- ``reduce-overhead`` outputs live in a CUDA-graph memory pool that the next replay overwrites:
  they are cloned, and :func:`mark_step` starts each training step and evaluation batch.

With compilation off this module imports nothing of ``torch._dynamo``; torchvision 0.29 imports
it by itself at its own import (``torchvision.ops.roi_align``: ~1 s of a CPU run's start-up),
which no option here avoids.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

AUTO = "auto"
OFF = ("", "off")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = ("eager", "aot_eager")
CHOICES = (AUTO, *OFF, *MODES, *BACKENDS)
GPU_MODE = "reduce-overhead"  # what ``auto`` compiles with on a CUDA device
# graphs kept per code object (torch's default 8): a worker process running several datasets'
# runs meets several class counts, each with training, no-grad and autocast variants
CACHE_SIZE_LIMIT = 64
# output agreement of the first compiled call with eager: max |compiled - eager| must stay
# within TOLERANCE[dtype] * max |eager| (+ a tiny absolute floor); reductions in another order,
# TF32 and fused kernels stay far inside, a wrong graph (stale buffer, wrong slice) does not
TOLERANCE = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
FP32_TOLERANCE = 1e-3
CHECKED_CALLS = 3  # per signature: warm-up run, CUDA-graph recording, first replay

_local = threading.local()


def check_compile_option(value: str) -> None:
    if value not in CHOICES:
        raise ValueError(
            f"MODEL.COMPILE must be one of {', '.join(repr(c) for c in CHOICES)}; got {value!r} "
            "(auto: reduce-overhead for training on a GPU, off otherwise)"
        )


def resolve_compile(value: str, device_type: str) -> str:
    """The mode (or backend) that ``MODEL.COMPILE = value`` compiles with on ``device_type``;
    ``""`` for none. ``auto`` gives :data:`GPU_MODE` on CUDA and ``""`` elsewhere."""
    check_compile_option(value)
    if value in OFF:
        return ""
    if value == AUTO:
        return GPU_MODE if device_type == "cuda" else ""
    return value


@contextlib.contextmanager
def eager():
    """Run every compiled encoder eagerly inside the block (in this thread): batches of another
    size than the compiled ones."""
    before = getattr(_local, "eager", False)
    _local.eager = True
    try:
        yield
    finally:
        _local.eager = before


def _leaves(tree) -> list:
    return torch.utils._pytree.tree_leaves(tree)


def signature(args: tuple, kwargs: dict) -> tuple:
    """What selects a compiled graph: tensor shapes/dtypes/devices, grad mode and autocast."""
    parts = []
    for x in _leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
        else:
            parts.append(type(x).__name__)
    autocast = tuple(
        torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
        for d in ("cpu", "cuda")
    )
    return (tuple(parts), torch.is_grad_enabled(), autocast)


def outputs_disagree(out, ref) -> str:
    """Why ``out`` (compiled) is not ``ref`` (eager) up to rounding; ``""`` when it is."""
    a, b = _leaves(out), _leaves(ref)
    if len(a) != len(b):
        return f"{len(a)} outputs instead of {len(b)}"
    for x, y in zip(a, b):
        if not isinstance(y, torch.Tensor):
            continue
        if not isinstance(x, torch.Tensor) or x.shape != y.shape:
            return f"output shape {getattr(x, 'shape', type(x))} instead of {tuple(y.shape)}"
        x, y = x.detach().float(), y.detach().float()
        if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return "non-finite values where eager has none (or the reverse)"
        if not y.numel():
            continue
        fin = torch.isfinite(y)
        diff = (x[fin] - y[fin]).abs().max() if fin.any() else torch.zeros(())
        scale = y[fin].abs().max() if fin.any() else torch.zeros(())
        tol = TOLERANCE.get(ref_dtype(ref), FP32_TOLERANCE)
        if float(diff) > tol * float(scale) + 1e-6:
            return f"max |compiled - eager| = {float(diff):.3g} (max |eager| {float(scale):.3g})"
    return ""


def ref_dtype(tree) -> torch.dtype:
    dts = [x.dtype for x in _leaves(tree) if isinstance(x, torch.Tensor)]
    return dts[0] if dts else torch.float32


def _devices(args, kwargs) -> list[int]:
    return sorted(
        {
            x.device.index or 0
            for x in _leaves((args, kwargs))
            if isinstance(x, torch.Tensor) and x.device.type == "cuda"
        }
    )


def graph_count() -> int:
    """Graphs compiled by ``torch._dynamo`` so far in this process (0 before any)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledForward:
    """A module's ``forward`` compiled with ``torch.compile`` (see the module docstring).

    Attributes:
        mode: the mode or backend.
        first_calls: signature -> seconds of its first call (compilation included).
        checks_left: signature -> calls still to check against eager.
        fallback: why the module went back to eager ("" while compiled).
    """

    def __init__(self, name: str, forward, mode: str):
        self.name = name
        self.eager_forward = forward
        self.mode = mode
        kwargs = {"backend": mode} if mode in BACKENDS else {"mode": mode}
        from .compile_cache import use_persistent_cache  # lazily: this module imports alone

        use_persistent_cache()  # one folder, shareable (engine/compile_cache.py)
        self.compiled = torch.compile(forward, dynamic=False, **kwargs)
        self.first_calls: dict[tuple, float] = {}
        self.checks_left: dict[tuple, int] = {}
        self.fallback = ""

    def __call__(self, *args, **kwargs):
        if self.fallback or getattr(_local, "eager", False):
            return self.eager_forward(*args, **kwargs)
        sig = signature(args, kwargs)
        if self.checks_left.get(sig, CHECKED_CALLS):
            return self._checked_call(sig, args, kwargs)
        try:
            return self._run(args, kwargs)
        except Exception as e:  # noqa: BLE001  (any failure of the compiled path: run eagerly)
            self._give_up(f"a compiled call raised {type(e).__name__}: {e}")
            return self.eager_forward(*args, **kwargs)

    def _run(self, args, kwargs):
        out = self.compiled(*args, **kwargs)
        if self.mode == "reduce-overhead":  # CUDA-graph outputs are overwritten by the next replay
            out = torch.utils._pytree.tree_map(
                lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out
            )
        return out

    def _checked_call(self, sig, args, kwargs):
        first = sig not in self.first_calls
        graphs = graph_count()
        start = time.perf_counter()
        try:
            out = self._run(args, kwargs)
            if torch.cuda.is_available() and _devices(args, kwargs):
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            what = "compilation failed with" if first else "a compiled call raised"
            self._give_up(f"{what} {type(e).__name__}: {e}")
            return self.eager_forward(*args, **kwargs)
        seconds = time.perf_counter() - start
        with torch.no_grad(), torch.random.fork_rng(devices=_devices(args, kwargs)):
            ref = self.eager_forward(*args, **kwargs)
        problem = outputs_disagree(out, ref)
        if problem:
            self._give_up(f"its output differs from eager: {problem}")
            return self.eager_forward(*args, **kwargs)
        self.checks_left[sig] = self.checks_left.get(sig, CHECKED_CALLS) - 1
        if not first:
            return out
        self.first_calls[sig] = seconds
        from . import compile_cache, phases

        phases.carve("compilation", seconds)  # the start-up phases of the run (engine.phases)
        compile_cache.note_compile(seconds)  # MODEL.COMPILE auto's record
        logger.info(
            "torch.compile (%s) %s: first call %.2f s (%d new graph(s) in this process), "
            "output equal to eager",
            self.mode,
            self.name,
            seconds,
            graph_count() - graphs,
        )
        return out

    def _give_up(self, reason: str) -> None:
        self.fallback = reason
        logger.warning(
            "torch.compile (%s) of %s: %s; it runs eagerly from now on (results are unaffected; "
            "MODEL.COMPILE off silences this)",
            self.mode,
            self.name,
            reason,
        )


def _encoder_types() -> tuple[type, ...]:
    """The modules whose ``forward`` is compiled: the prompt-dependent encoders and CLIP's image
    tower (frozen in CoOp-style trainers, whose training steps encode every batch with it)."""
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.transformer import VisionTransformer

    from .clip.text import TextEncoder
    from .clip.vision import PromptedVisionEncoder

    return (TextEncoder, PromptedVisionEncoder, VisionTransformer, ModifiedResNet)


def compile_encoders(model: nn.Module, mode: str) -> list[str]:
    """Compile the ``forward`` of every text encoder, prompted vision encoder and CLIP image
    tower in ``model`` with ``mode`` (a resolved value, see :func:`resolve_compile`).

    Returns the names of the compiled modules (already compiled ones are skipped).
    """
    if not mode:
        return []
    if mode not in MODES + BACKENDS:
        raise ValueError(f"not a torch.compile mode or backend: {mode!r}")
    import torch._dynamo

    from .clip.text import TextEncoder

    types = _encoder_types()
    torch._dynamo.config.cache_size_limit = max(
        torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT
    )
    compiled, eager_text = [], []
    for name, module in model.named_modules():
        if isinstance(module, types) and not isinstance(
            module.__dict__.get("forward"), CompiledForward
        ):
            label = name or type(module).__name__
            if isinstance(module, TextEncoder) and module.saves_memory:
                eager_text.append(label)  # a loop of checkpointed chunks: not compiled
                continue
            module.forward = CompiledForward(label, module.forward, mode)
            compiled.append(label)
    logger.info("torch.compile (%s): %s", mode, ", ".join(compiled) or "no encoder found")
    if eager_text:
        logger.info(
            "Not compiled (MODEL.TEXT_CHUNK / MODEL.CHECKPOINT_TEXT / MODEL.SHARED_PREFIX on: "
            "chunked, checkpointed or prefix-shared text encoding runs eagerly): %s",
            ", ".join(eager_text),
        )
    return compiled


def compiled_forwards(model: nn.Module) -> dict[str, CompiledForward]:
    """The compiled forwards of ``model``'s modules, by module name."""
    return {
        name or type(m).__name__: m.__dict__["forward"]
        for name, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), CompiledForward)
    }


def release_cuda_graphs() -> None:
    """Free the CUDA graphs that ``reduce-overhead`` recorded (and their memory pools). A packed
    worker calls it between runs: the next run's parameters are new tensors, so the old graphs
    cannot be replayed, and they would hold memory for the rest of the process. The compiled
    code stays cached (no compilation again); the next run records its graphs anew. A no-op
    unless CUDA-graph trees were used in this process."""
    if "torch._inductor.cudagraph_trees" not in sys.modules:
        return
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()


def mark_step() -> None:
    """Start a new CUDA-graph step (needed by mode reduce-overhead between iterations); a no-op
    when nothing was compiled in this process (torch._dynamo never imported)."""
    if "torch._dynamo" not in sys.modules:
        return
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()
