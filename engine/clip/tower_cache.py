"""Built CLIP towers kept between the runs of a packed worker, handed out as copies.

Building a CLIP from a checkpoint costs two passes over its weights: open_clip's constructor
draws a random initialisation (on CPU, 212 million draws for ViT-B/16) that
``load_state_dict`` then overwrites. A worker (``engine/runner.py``) that runs many runs on one
checkpoint keeps the first tower it built (the *pristine* one, as
:func:`engine.clip.model.clip_from_state_dict` returned it) and gives each later run its own
``copy.deepcopy`` of it: parameters, buffers, dtypes, ``requires_grad`` and modes as a fresh
build, in memory of the run's own, so a trainer that fine-tunes CLIP weights (SkipTuning, MMRL)
changes its copy only.

A run's results must not depend on whether its tower was copied: what it draws after the tower
(the prompt initialisation, the loader's shuffling seed) comes from torch's CPU generator, which
the skipped initialisation would have advanced. The first build records how many 32-bit
Mersenne Twister draws it took (the generator's state before and after, matched draw by draw);
a copy advances the generator by that count (numpy's MT19937, the same generator, without
producing values), so the generator ends where the build would have left it, byte for byte.
A build whose draws cannot be replayed this way (torch's cached normal samples in play before or
after it) is not cached: every run builds its tower then. A tower built with random weights
(``MODEL.BACKBONE.PRETRAINED False``) depends on the generator's state itself; it is keyed by
that state and hands back the state the build left.

Off by default (:func:`cache_towers`; the worker turns it on): a single run would only hold a
second copy of the weights. ``tests/test_tower_cache.py`` checks copies against fresh builds.
"""

from __future__ import annotations

import copy
import logging
import os
import os.path as osp
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAX_TOWERS = 2  # pristine towers kept (e.g. one fp16 and one fp32 build of a grid's checkpoint)

# torch's CPU generator state (torch.get_rng_state(): CPUGeneratorImplState, 5,056 bytes):
# uint64 seed | int32 left | int32 seeded | uint64 next | uint64 state[624] | double normal_x,
# normal_y, normal_rho | int32 normal_is_valid | pad | float next_float_normal | bool valid | pad
_N = 624  # Mersenne Twister words
_LEFT, _NEXT, _WORDS = slice(8, 12), slice(16, 24), slice(24, 24 + 8 * _N)
_DOUBLE_NORMAL_VALID, _FLOAT_NORMAL_VALID = slice(5040, 5044), 5052
_STATE_BYTES = 5056


@dataclass
class _Tower:
    model: torch.nn.Module  # the pristine tower (never handed out)
    draws: int | None = None  # 32-bit draws its build took (checkpoint towers)
    rng_after: torch.Tensor | None = None  # the generator state it left (random-weight towers)


_TOWERS: OrderedDict[tuple, _Tower] = OrderedDict()
_UNREPLAYABLE: set[tuple] = set()  # towers whose builds' draws no count replays: built each time
_enabled = False
stats = {"built": 0, "copied": 0}  # this process's towers (tests, the packed-gap benchmark)


def cache_towers(enabled: bool = True) -> None:
    """Keep built towers for later runs of this process (on in packed workers); ``False`` also
    drops the kept ones."""
    global _enabled
    _enabled = enabled
    if not enabled:
        _TOWERS.clear()
        _ADVANCED.clear()
        _UNREPLAYABLE.clear()


def towers_cached() -> bool:
    return _enabled


def _mt_position(state: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(the 624 words, numpy's position) of a torch CPU generator state; None when torch has a
    cached normal sample (then the next draws depend on more than the words)."""
    if len(state) != _STATE_BYTES:
        return None
    if state[_DOUBLE_NORMAL_VALID].any() or state[_FLOAT_NORMAL_VALID]:
        return None
    left = int(state[_LEFT].view(np.int32)[0])
    nxt = int(state[_NEXT].view(np.uint64)[0])
    words = state[_WORDS].view(np.uint64).astype(np.uint32)
    # torch draws state[next++] after a twist when --left reaches 0: left == 1 means a twist is
    # due (numpy's position 624); otherwise left + next == 625 and the position is next
    return words, (_N if left == 1 else nxt)


def _with_position(state: np.ndarray, words: np.ndarray, pos: int) -> np.ndarray:
    out = state.copy()
    out[_WORDS] = words.astype(np.uint64).view(np.uint8)
    out[_LEFT] = np.array([_N + 1 - pos], np.int32).view(np.uint8)
    out[_NEXT] = np.array([pos], np.uint64).view(np.uint8)
    return out


def _generator(words: np.ndarray, pos: int) -> np.random.MT19937:
    gen = np.random.MT19937(0)
    gen.state = {"bit_generator": "MT19937", "state": {"key": words, "pos": pos}}
    return gen


def _temper(words: np.ndarray) -> np.ndarray:
    """The Mersenne Twister's outputs of state words (its tempering)."""
    y = words.astype(np.uint32)
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    y ^= y >> np.uint32(18)
    return y


_SEARCH_BLOCKS = 4096  # twists generated per step of draws_between (10 MB of draws)


def draws_between(before: torch.Tensor, after: torch.Tensor, limit: int) -> int | None:
    """How many 32-bit draws take torch's CPU generator from state ``before`` to ``after``
    (at most ``limit``); None when no count does, or a cached normal sample is involved."""
    a, b = before.numpy(), after.numpy()
    start, end = _mt_position(a), _mt_position(b)
    if start is None or end is None:
        return None
    (words, pos), (target, target_pos) = start, end
    if np.array_equal(words, target) and target_pos >= pos:
        return target_pos - pos  # no twist between them
    gen = _generator(words, pos)
    gen.random_raw(_N - pos, output=False)  # to the end of the current block
    # after the k-th twist from here the generator outputs the tempered words of its state:
    # find the block whose outputs are ``target``'s tempered words
    want = _temper(target)
    done = 0  # whole blocks drawn after the current one
    while (_N - pos) + _N * done + target_pos <= limit:
        blocks = gen.random_raw(_N * _SEARCH_BLOCKS).astype(np.uint32).reshape(-1, _N)
        for j in np.flatnonzero(blocks[:, 0] == want[0]):
            if np.array_equal(blocks[j], want):
                return (_N - pos) + _N * (done + int(j)) + target_pos
        done += _SEARCH_BLOCKS
    return None


# advance()'s results for the last generator states seen: the runs of a grid repeat their seeds
# (the same trainer or dataset with other optimizers), so a state comes back, seeded the same way
_ADVANCED: OrderedDict[tuple[bytes, int], torch.Tensor] = OrderedDict()
MAX_ADVANCED = 64  # 5 KB each


def advance(state: torch.Tensor, draws: int) -> torch.Tensor | None:
    """Torch's CPU generator state ``draws`` 32-bit draws after ``state``; None when a cached
    normal sample is involved. The draws cost about as much as producing them (numpy's raw
    MT19937, no values written), except for a state among the last ones advanced."""
    a = state.numpy()
    key = (a.tobytes(), draws)
    if key in _ADVANCED:
        _ADVANCED.move_to_end(key)
        return _ADVANCED[key].clone()
    start = _mt_position(a)
    if start is None:
        return None
    if draws == 0:
        return state.clone()
    gen = _generator(*start)
    gen.random_raw(draws, output=False)
    s = gen.state["state"]
    after = torch.from_numpy(_with_position(a, s["key"], int(s["pos"])))
    _ADVANCED[key] = after.clone()
    while len(_ADVANCED) > MAX_ADVANCED:
        _ADVANCED.popitem(last=False)
    return after


def _keep(key: tuple, tower: _Tower) -> None:
    _TOWERS[key] = tower
    _TOWERS.move_to_end(key)
    while len(_TOWERS) > MAX_TOWERS:
        _TOWERS.popitem(last=False)


def _draw_limit(model: torch.nn.Module) -> int:
    """A bound on the draws of a build: a few per weight (an init and a re-init, 64-bit draws)."""
    n = sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())
    return 8 * n + 1_000_000


def checkpoint_tower(key: tuple | None, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` (a CLIP holding a checkpoint's weights; ``key`` names everything it depends
    on, None: nothing to key it by), or, with the cache on, a copy of the tower an earlier call
    built for ``key``, with torch's CPU generator advanced as ``build()`` would have advanced
    it."""
    if not _enabled or key is None:
        return build()
    tower = _TOWERS.get(key)
    if tower is not None and tower.draws is not None:
        before = torch.get_rng_state()
        if _mt_position(before.numpy()) is not None:
            # the draws (numpy releases the GIL) while the weights are copied
            with ThreadPoolExecutor(max_workers=1) as pool:
                after = pool.submit(advance, before, tower.draws)
                model = copy.deepcopy(tower.model)
                torch.set_rng_state(after.result())
            _TOWERS.move_to_end(key)
            stats["copied"] += 1
            return model
    before = torch.get_rng_state()
    model = build()
    stats["built"] += 1
    if tower is not None or key in _UNREPLAYABLE:
        return model
    draws = draws_between(before, torch.get_rng_state(), _draw_limit(model))
    if draws is not None:
        _keep(key, _Tower(copy.deepcopy(model), draws=draws))
    elif _mt_position(before.numpy()) is not None:  # not a passing cached normal sample: never
        logger.info("CLIP tower not kept: its build's random draws cannot be replayed")
        _UNREPLAYABLE.add(key)
    return model


def random_tower(key: tuple, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` (a CLIP with random weights), or, with the cache on, a copy of the tower an
    earlier call built for ``key`` from the same generator state, leaving the generator in the
    state that build left."""
    if not _enabled:
        return build()
    full = (*key, bytes(torch.get_rng_state().numpy()))
    tower = _TOWERS.get(full)
    if tower is not None:
        model = copy.deepcopy(tower.model)
        torch.set_rng_state(tower.rng_after)
        _TOWERS.move_to_end(full)
        stats["copied"] += 1
        return model
    model = build()
    stats["built"] += 1
    _keep(full, _Tower(copy.deepcopy(model), rng_after=torch.get_rng_state()))
    return model


def file_key(path: str) -> tuple:
    """A file as a cache key: its real path, size and modification time."""
    st = os.stat(path)
    return osp.realpath(path), st.st_size, st.st_mtime_ns
