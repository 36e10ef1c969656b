"""``MODEL.TEXT_MEMORY auto``: the fastest text-memory variant that fits the free memory.

The training step's text side keeps the activations of ``prompts x tokens x width x blocks``
(docs/backbones.md, "Memory at ImageNet scale"). The variants, and what each keeps of them:

- ``plain``: all of them;
- ``shared prefix`` (``MODEL.SHARED_PREFIX``): the common ``[SOS][ctx]`` once, each class's own
  tokens per class: :data:`SHARED_PREFIX_FRACTION` of plain (measured: 57-64% on CPU for six
  trainers at 1,000 classes, 61% for CoOp on the H200);
- ``shared prefix + checkpointed chunks`` and ``checkpointed chunks`` (``MODEL.TEXT_CHUNK`` and
  ``MODEL.CHECKPOINT_TEXT``): one chunk's worth of the above.

The rule (:func:`choose`): estimate the plain variant's text activations (:func:`text_bytes`),
then take the first variant, in the device's order of measured speed (:data:`SPEED_ORDER`),
whose estimate fits :data:`HEADROOM` of the free memory measured once the model is built
(the weights are then already counted as used); when none fits, the smallest. The speed orders
are measured: on the H200 (issue 30, CoOp, 1,000 classes) plain 43.6 ms, shared prefix 62.8 ms,
checkpointed chunks 394 ms; on CPU (docs/backbones.md's table) shared prefix 0.50-0.72x plain,
with checkpointed chunks 0.69-0.92x, checkpointed chunks alone 1.24-1.47x. The
shared-prefix-with-checkpointed-chunks variant has not been timed on a GPU: it is placed
between the shared prefix and checkpointed chunks alone, as on CPU. Not checked on a GPU
either: the estimate against its allocator (the constant below comes from the CPU accounting;
for CoOp's 1,000 ViT-B/16 classes in fp16 at about 20 tokens it gives 3.6 GiB, the issue
measured a 3.6 GB step).

Every variant gives the plain path's losses and gradients up to fp32 rounding
(tests/test_text_memory.py, tests/test_text_shared_prefix.py), so the choice changes speed and
memory, not results beyond rounding.
"""

from __future__ import annotations

import logging
import os

import torch

from .text import TextEncoder, TextOptions

logger = logging.getLogger(__name__)

# activations a training step keeps per token x width x block of the text tower, in values:
# measured 1.1 MiB per class at 16 tokens, width 128, 9 blocks, fp32 (docs/backbones.md)
VALUES_PER_TOKEN_WIDTH_BLOCK = 15.6
SHARED_PREFIX_FRACTION = 0.65
HEADROOM = 0.8  # of the free memory: allocator fragmentation and the image side's activations
DEFAULT_CHUNK = 100  # classes per checkpointed chunk unless MODEL.TEXT_CHUNK says otherwise

PLAIN, SHARED, SHARED_CKPT, CKPT = (
    "plain",
    "shared prefix",
    "shared prefix + checkpointed chunks",
    "checkpointed chunks",
)
SPEED_ORDER = {
    "cuda": (PLAIN, SHARED, SHARED_CKPT, CKPT),
    "cpu": (SHARED, SHARED_CKPT, PLAIN, CKPT),
}


def text_bytes(prompts: int, tokens: int, width: int, blocks: int, element_bytes: int) -> float:
    """Estimated bytes of a training step's text activations, plain variant."""
    return VALUES_PER_TOKEN_WIDTH_BLOCK * prompts * tokens * width * blocks * element_bytes


def variant_bytes(plain: float, prompts: int, chunk: int) -> dict[str, float]:
    """The estimate of every variant from the plain one (chunks of ``chunk`` prompts)."""
    part = min(chunk, prompts) / max(prompts, 1)
    return {
        PLAIN: plain,
        SHARED: SHARED_PREFIX_FRACTION * plain,
        SHARED_CKPT: SHARED_PREFIX_FRACTION * plain * part,
        CKPT: plain * part,
    }


def options_of(variant: str, chunk: int) -> TextOptions:
    return {
        PLAIN: TextOptions(),
        SHARED: TextOptions(shared_prefix=True),
        SHARED_CKPT: TextOptions(chunk=chunk, checkpoint=True, shared_prefix=True),
        CKPT: TextOptions(chunk=chunk, checkpoint=True),
    }[variant]


def choose(
    plain: float, prompts: int, free: float, device_type: str, chunk: int = DEFAULT_CHUNK
) -> tuple[str, str]:
    """``(variant, why)``: the first variant of :data:`SPEED_ORDER` whose estimate fits
    ``HEADROOM x free`` bytes, else the smallest."""
    need = variant_bytes(plain, prompts, chunk)
    budget = HEADROOM * free
    order = SPEED_ORDER["cuda" if device_type == "cuda" else "cpu"]
    gib = 2**30
    for variant in order:
        if need[variant] <= budget:
            return variant, (
                f"{variant}: estimated {need[variant] / gib:.2f} GiB of text activations fits "
                f"{HEADROOM:.0%} of {free / gib:.2f} GiB free (plain: {plain / gib:.2f} GiB; "
                f"fastest first on {device_type}: {', '.join(order)})"
            )
    smallest = min(need, key=need.get)
    return smallest, (
        f"{smallest}: the smallest variant, estimated {need[smallest] / gib:.2f} GiB, does not "
        f"fit {HEADROOM:.0%} of {free / gib:.2f} GiB free; lower MODEL.TEXT_CHUNK or the batch"
    )


def free_memory(device: torch.device) -> float:
    """Free bytes where the model runs: the GPU's (``torch.cuda.mem_get_info``), else the host's
    available memory (``MemAvailable`` of /proc/meminfo; the physical memory elsewhere)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def model_text_shape(model: torch.nn.Module) -> tuple[int, int, int, int, int] | None:
    """``(prompts, tokens, width, blocks, element bytes)`` of ``model``'s class prompts and
    text tower, or None when it has no text encoder or no registered class prompts."""
    encoders = [m for m in model.modules() if isinstance(m, TextEncoder)]
    eots = [b for n, b in model.named_buffers() if n.endswith("eot_idx") and b.numel()]
    if not encoders or not eots:
        return None
    tower = encoders[0].transformer
    width = int(getattr(tower, "width", encoders[0].ln_final.weight.shape[0]))
    blocks = int(getattr(tower, "layers", len(getattr(tower, "resblocks", []))))
    element = encoders[0].ln_final.weight.element_size()
    prompts = max(int(e.shape[0]) for e in eots)
    tokens = max(int(e.max()) + 1 for e in eots)
    return prompts, tokens, width, blocks, element


def auto_options(cfg, model: torch.nn.Module, device: torch.device) -> TextOptions:
    """The :class:`TextOptions` that ``MODEL.TEXT_MEMORY auto`` picks for ``model`` (logged)."""
    shape = model_text_shape(model)
    if shape is None:
        return TextOptions()
    prompts, tokens, width, blocks, element = shape
    chunk = int(cfg.MODEL.TEXT_CHUNK) or DEFAULT_CHUNK
    plain = text_bytes(prompts, tokens, width, blocks, element)
    variant, why = choose(plain, prompts, free_memory(device), device.type, chunk)
    log = logger.warning if "does not fit" in why else logger.info
    log(
        "MODEL.TEXT_MEMORY auto: %s (%d prompts x %d tokens, width %d, %d blocks)",
        why,
        prompts,
        tokens,
        width,
        blocks,
    )
    return options_of(variant, chunk)
