"""YAML config files parsed once per process while they stay unchanged (packed workers).

A run reads each of its config files twice (``engine.plugins.plugins_in_files`` for ``PLUGINS``,
then :func:`engine.config.merge_from_file`), and every run of a packed worker
(``engine/runner.py``) reads the same trainer and dataset files again. With the cache on
(:func:`cache_yaml`, turned on by the worker), a file is parsed once per (real path, size,
modification time) and every caller gets its own deep copy of the parsed values, so a caller
that changes them changes nothing for the next. Off by default: a single run would only hold the
memory, and :func:`read_yaml` then parses the file each time, as ``yaml.safe_load`` does.
"""

from __future__ import annotations

import copy
import os
import os.path as osp

import yaml

_CACHE: dict[tuple, object] = {}
_enabled = False
MAX_FILES = 256  # parsed files kept (a grid uses a few dozen config files)


def cache_yaml(enabled: bool = True) -> None:
    """Turn the parsed-file cache on or off (off also empties it)."""
    global _enabled
    _enabled = enabled
    if not enabled:
        _CACHE.clear()


def read_yaml(path: str):
    """``yaml.safe_load`` of the file at ``path`` (None for an empty file); raises what
    ``open`` and ``yaml.safe_load`` raise. With the cache on, a file unchanged since it was
    parsed (same real path, size and modification time) is not read again; the caller gets a
    deep copy of its values."""
    if not _enabled:
        with open(path) as f:
            return yaml.safe_load(f)
    st = os.stat(path)
    key = (osp.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        with open(path) as f:
            values = yaml.safe_load(f)
        if len(_CACHE) >= MAX_FILES:
            _CACHE.clear()
        _CACHE[key] = values
    return copy.deepcopy(_CACHE[key])
