"""What a packed worker keeps between runs besides the CLIP towers (engine.runner's
enable_run_caches): parsed YAML config files, and the config.yaml text every run writes."""

from __future__ import annotations

import glob
import os
import os.path as osp

import pytest
import yaml
from conftest import ROOT

from engine import yaml_files


@pytest.fixture
def yaml_cache():
    yaml_files.cache_yaml(True)
    yield
    yaml_files.cache_yaml(False)


def test_a_cached_yaml_file_is_parsed_once_and_every_caller_gets_its_own_values(
    tmp_path, yaml_cache, monkeypatch
):
    path = tmp_path / "a.yaml"
    path.write_text("OPTIM:\n  LR: 0.002\n  NAME: sgd\n")
    parses = []
    real = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda f: parses.append(1) or real(f))
    first = yaml_files.read_yaml(str(path))
    first["OPTIM"]["LR"] = 99.0  # a caller changing its values changes nobody else's
    assert yaml_files.read_yaml(str(path)) == {"OPTIM": {"LR": 0.002, "NAME": "sgd"}}
    assert len(parses) == 1
    path.write_text("OPTIM:\n  LR: 0.5\n")  # changed (size and time): parsed again
    os.utime(path, ns=(1, 1))
    assert yaml_files.read_yaml(str(path)) == {"OPTIM": {"LR": 0.5}}
    assert len(parses) == 2
    yaml_files.cache_yaml(False)  # off: parsed every time, as yaml.safe_load
    yaml_files.read_yaml(str(path))
    yaml_files.read_yaml(str(path))
    assert len(parses) == 4


def test_config_yaml_text_is_yacs_dump_for_the_shipped_configs():
    from engine.config import cfg_yaml, get_cfg_default, merge_from_file

    assert getattr(yaml, "CSafeDumper", None) is not None  # else cfg_yaml is cfg.dump() itself
    files = sorted(glob.glob(osp.join(ROOT, "configs", "trainers", "*", "*.yaml")))[::15]
    files += sorted(glob.glob(osp.join(ROOT, "configs", "datasets", "*.yaml")))[::5]
    assert len(files) > 6
    odd = ["/tmp/a path: with ' \" # - x", "\\ back", "#c", "- a", "", "~", "null", "1e3", "yes"]
    for k, path in enumerate(files):
        cfg = get_cfg_default()
        merge_from_file(cfg, path)
        cfg.OUTPUT_DIR = odd[k % len(odd)] + " long" * (k * 7 % 40)  # quoting, folding
        cfg.DATASET.SOURCE_DOMAINS = ("x", "y: z", odd[(k + 1) % len(odd)])
        assert cfg_yaml(cfg) == cfg.dump(), path
        cfg.DATASET.ROOT = "/données/é" + " long" * 20  # libyaml escapes and folds these otherwise
        assert cfg_yaml(cfg) == cfg.dump(), path


def test_image_verdicts_are_kept_for_unchanged_files_only(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from PIL import Image

    from engine.data import image_check

    paths = [str(tmp_path / f"{k}.jpg") for k in range(3)]
    for p in paths:
        Image.new("RGB", (8, 8), (40, 90, 140)).save(p)
    items = [SimpleNamespace(impath=p) for p in paths]
    reads = []
    real = image_check.image_problem
    monkeypatch.setattr(image_check, "image_problem", lambda p: reads.append(p) or real(p))
    image_check.cache_verdicts(True)
    try:
        assert image_check.find_unreadable(items) == []
        assert image_check.find_unreadable(items) == [] and len(reads) == 3  # not read again
        with open(paths[1], "r+b") as f:  # truncated: another size, another verdict
            f.truncate(40)
        bad = image_check.find_unreadable(items)
        assert [p for p, _ in bad] == [paths[1]] and reads[3:] == [paths[1]]
        os.remove(paths[2])
        assert [r for _, r in image_check.find_unreadable(items)][-1] == "file not found"
    finally:
        image_check.cache_verdicts(False)
    assert image_check.find_unreadable(items[:1]) == [] and len(reads) == 5  # off: read again
