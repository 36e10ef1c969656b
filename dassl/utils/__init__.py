"""Dassl's ``dassl.utils`` (and its modules ``tools``, ``torchtools``, ``meters``, ``logger``,
``registry``) over the engine's utilities."""

from .logger import setup_logger
from .meters import AverageMeter, MetricMeter
from .registry import Registry
from .tools import (
    check_isfile,
    collect_env_info,
    listdir_nohidden,
    mkdir_if_missing,
    read_image,
    read_json,
    set_random_seed,
    tolist_if_not,
    write_json,
)
from .torchtools import count_num_param, load_checkpoint, load_pretrained_weights, save_checkpoint

__all__ = [
    "AverageMeter",
    "MetricMeter",
    "Registry",
    "check_isfile",
    "collect_env_info",
    "count_num_param",
    "listdir_nohidden",
    "load_checkpoint",
    "load_pretrained_weights",
    "mkdir_if_missing",
    "read_image",
    "read_json",
    "save_checkpoint",
    "set_random_seed",
    "setup_logger",
    "tolist_if_not",
    "write_json",
]
