"""Dassl's ``dassl.utils.tools``: files, JSON, seeds, images, environment."""

from engine.data import read_image
from engine.utils import (
    check_isfile,
    collect_env_info,
    listdir_nohidden,
    mkdir_if_missing,
    read_json,
    set_random_seed,
    write_json,
)

__all__ = [
    "check_isfile",
    "collect_env_info",
    "listdir_nohidden",
    "mkdir_if_missing",
    "read_image",
    "read_json",
    "set_random_seed",
    "tolist_if_not",
    "write_json",
]


def tolist_if_not(x):
    """``x`` as a list (Dassl's helper)."""
    return x if isinstance(x, list) else [x]
