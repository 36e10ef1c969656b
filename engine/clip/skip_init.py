"""Building a CLIP whose weights come from a file without paying for its random initialisation.

Building a ViT-B/16 CLIP draws ~150 M random numbers to initialise weights that the checkpoint
then overwrites: most of the "clip weights" start-up phase (docs/performance.md). The draws
cannot simply be skipped: they advance torch's global CPU generator, and what is drawn after the
build (the prompt vectors of CoOp and the other learners) must stay what it is in every run.

:func:`build_then_load` therefore builds the model once as before (the random initialisation
runs) and records the generator's state after the build in a small file under
``$SAMPLE_PL_CACHE/clip_init`` (:func:`cache_dir`), named by a digest of everything that decides
it: the generator's state before the build, the model's description (its config and precision,
or the shapes of an OpenAI checkpoint), the torch version and the CPU's vector instructions. A
later build with the same digest (another process, another dataset or optimizer with the same
seed and backbone) skips the in-place random fills of the model's parameters (every parameter is
overwritten by the checkpoint, which ``load_state_dict(strict=True)`` checks) and sets the
generator to the recorded state: the same weights, the same generator state, the same run. Fills
of anything that is not a parameter (buffers, temporaries) still run. A record that cannot be
read or fails its checksum is ignored (the full build runs and writes it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import os.path as osp

import torch
from torch.overrides import TorchFunctionMode

from engine.utils import atomic_write_bytes, user_cache_dir

logger = logging.getLogger(__name__)

# in-place random fills that nn.init and nn.Module constructors apply to parameters
_RANDOM_FILLS = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
    # nn.init functions that hand themselves to a torch-function mode (their own fills are then
    # out of the mode's sight)
    torch.nn.init.uniform_,
    torch.nn.init.normal_,
    torch.nn.init.kaiming_uniform_,
}
_STATE_BYTES = len(torch.get_rng_state())  # the CPU generator's state (mt19937 and its caches)
builds = {"full": 0, "recorded": 0}  # builds of this process by kind (what tests look at)


def cache_dir() -> str:
    """``$SAMPLE_PL_CACHE/clip_init`` (default ``~/.cache/sample-pl/clip_init``)."""
    return user_cache_dir("clip_init")


class _SkipParameterFills(TorchFunctionMode):
    """Random in-place fills of parameters do nothing (their values are overwritten later)."""

    def __init__(self):
        super().__init__()
        self.skipped = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:  # nn.init passes the tensor by keyword
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.nn.Parameter):
                self.skipped += 1
                return target
        return func(*args, **kwargs)


def _digest(description) -> str:
    h = hashlib.sha256()
    h.update(torch.get_rng_state().numpy().tobytes())
    parts = {
        "model": description,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _read_record(path: str) -> torch.Tensor | None:
    """The recorded generator state in ``path`` (state bytes + their SHA256), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    state, check = data[:_STATE_BYTES], data[_STATE_BYTES:]
    if len(state) != _STATE_BYTES or hashlib.sha256(state).hexdigest().encode() != check:
        logger.warning("Ignoring the damaged CLIP build record %s", path)
        return None
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def build_then_load(build, load, description):
    """``load(build())``: the model ``build()`` makes, holding the weights ``load`` puts into
    every parameter; afterwards torch's CPU generator is where ``build()`` leaves it.

    ``description`` (JSON-serialisable) must name everything that decides the random draws of
    ``build()`` besides the generator's state, torch version and CPU (e.g. the model config and
    precision). ``load`` must overwrite every parameter (``load_state_dict(strict=True)``).
    """
    path = osp.join(cache_dir(), _digest(description) + ".state")
    state = _read_record(path)
    if state is None:
        builds["full"] += 1
        model = build()
        after = torch.get_rng_state()
        load(model)
        try:
            os.makedirs(cache_dir(), exist_ok=True)
            raw = after.numpy().tobytes()
            atomic_write_bytes(path, raw + hashlib.sha256(raw).hexdigest().encode())
        except OSError as e:  # a read-only cache: every build stays a full one
            logger.warning("Cannot record the CLIP build in %s (%s)", path, e)
        return model
    builds["recorded"] += 1
    with _SkipParameterFills() as mode:
        model = build()
    load(model)
    torch.set_rng_state(state)
    logger.debug("Built CLIP without its random fills (%d skipped; %s)", mode.skipped, path)
    return model
