"""Optional ``torch.compile`` of the prompt-dependent encoders (``MODEL.COMPILE``).

On a GPU the text encoder of a prompt learner is launch-bound: 100 class prompts of 16 tokens
through ViT-B/16's 12 text blocks are ~540 small kernels forward and backward. Measured on one
H200 (fp16 CLIP, CoOp's prompts, 100 classes, forward + backward of the text encoder alone):
19 ms eager, 9.6 ms with ``max-autotune-no-cudagraphs``, 3.0 ms with ``reduce-overhead`` (CUDA
graphs). The option is off by default: compilation takes seconds to minutes per run, fp16
results differ by rounding (max |difference| 8e-3 in fp16 features), and full training runs
with it were not timed here.

With the option off this module imports nothing of ``torch._dynamo`` (``torch.compile`` and the
CUDA-graph step marker are reached only when it is on); torchvision 0.29 imports
``torch._dynamo`` by itself at its own import (``torchvision.ops.roi_align``: ~2 s of a CPU
run's start-up), which no option here avoids.

Values: "" (off), a ``torch.compile`` mode ("default", "reduce-overhead", "max-autotune",
"max-autotune-no-cudagraphs"), or a backend for debugging ("eager", "aot_eager").
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
BACKENDS = ("eager", "aot_eager")


def check_compile_option(value: str) -> None:
    if value and value not in MODES + BACKENDS:
        raise ValueError(
            f"MODEL.COMPILE must be empty or one of {', '.join(MODES + BACKENDS)}; got {value!r}"
        )


def compile_encoders(model: nn.Module, value: str) -> list[str]:
    """Compile the ``forward`` of every text encoder and prompted vision encoder in ``model``.

    Returns the names of the compiled modules.
    """
    check_compile_option(value)
    if not value:
        return []
    from .clip.text import TextEncoder
    from .clip.vision import PromptedVisionEncoder

    kwargs = {"backend": value} if value in BACKENDS else {"mode": value}
    compiled = []
    for name, module in model.named_modules():
        if isinstance(module, (TextEncoder, PromptedVisionEncoder)) and not getattr(
            module, "_compiled", False
        ):
            fn = torch.compile(module.forward, dynamic=False, **kwargs)
            if value == "reduce-overhead":  # CUDA-graph outputs are reused buffers: copy them
                fn = _cloning(fn)
            module.forward = fn
            module._compiled = True
            compiled.append(name or type(module).__name__)
    logger.info("torch.compile (%s): %s", value, ", ".join(compiled) or "no encoder found")
    return compiled


def _cloning(fn):
    def call(*args, **kwargs):
        return fn(*args, **kwargs).clone()

    return call


def mark_step() -> None:
    """Start a new CUDA-graph step (needed by mode reduce-overhead between iterations); a no-op
    when nothing was compiled in this process (torch._dynamo never imported)."""
    if "torch._dynamo" not in sys.modules:
        return
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()
