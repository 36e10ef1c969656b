"""Config defaults, strict merging and the error messages for bad keys/values."""

from __future__ import annotations

import os.path as osp
import re

import pytest
from conftest import ROOT, make_cfg

from engine.config import (
    ConfigError,
    get_base_cfg_default,
    get_cfg_default,
    merge_from_file,
    merge_from_list,
)


def test_dassl_defaults():
    cfg = get_base_cfg_default()
    assert cfg.SEED == -1 and cfg.OUTPUT_DIR == "./output" and cfg.USE_CUDA is True
    assert cfg.OPTIM.NAME == "adam" and cfg.OPTIM.LR == 0.0003 and cfg.OPTIM.MAX_EPOCH == 10
    assert cfg.OPTIM.WARMUP_CONS_LR == 1e-5 and cfg.OPTIM.WARMUP_RECOUNT is True
    assert cfg.DATALOADER.TRAIN_X.BATCH_SIZE == 32 and cfg.DATALOADER.NUM_WORKERS == 4
    assert cfg.DATASET.SUBSAMPLE_CLASSES == "all" and cfg.DATASET.NUM_SHOTS == -1
    assert cfg.TEST.FINAL_MODEL == "last_step" and cfg.INPUT.SIZE == (224, 224)


def test_every_key_is_commented():
    """Each `_C.X = value` line in engine/config.py carries a comment (or one right above)."""
    lines = open(osp.join(ROOT, "engine", "config.py")).read().splitlines()
    missing = []
    for i, line in enumerate(lines):
        is_key = re.match(r"^_C\.[A-Z0-9_.]+ = (?!CN\(\))", line)
        if is_key and "#" not in line and not lines[i - 1].lstrip().startswith("#"):
            missing.append(line)
    assert not missing, missing


def test_trainer_keys_added():
    cfg = get_cfg_default()
    assert cfg.TRAINER.COOP.N_CTX == 16 and cfg.TRAINER.COOP.PREC == "fp16"


def test_unknown_key_names_key_and_suggests():
    cfg = get_cfg_default()
    with pytest.raises(ConfigError, match=r"Unknown config key 'OPTIM.LRR'.*OPTIM.LR"):
        merge_from_list(cfg, ["OPTIM.LRR", "0.1"])


def test_wrong_type_names_key():
    cfg = get_cfg_default()
    with pytest.raises(ConfigError, match=r"OPTIM.MAX_EPOCH expects an int.*'ten'"):
        merge_from_list(cfg, ["OPTIM.MAX_EPOCH", "ten"])
    with pytest.raises(ConfigError, match=r"OPTIM.LR expects a float"):
        merge_from_list(cfg, ["OPTIM.LR", "fast"])


def test_coercions():
    cfg = get_cfg_default()
    merge_from_list(
        cfg,
        [
            "OPTIM.LR",
            "1",
            "INPUT.SIZE",
            "(32, 32)",
            "OPTIM.STEPSIZE",
            "[5, 8]",
            "USE_CUDA",
            "false",
        ],
    )
    assert cfg.OPTIM.LR == 1.0 and isinstance(cfg.OPTIM.LR, float)
    assert cfg.INPUT.SIZE == (32, 32) and cfg.OPTIM.STEPSIZE == (5, 8)
    assert cfg.USE_CUDA is False


def test_odd_options():
    with pytest.raises(ConfigError, match="KEY VALUE pairs"):
        merge_from_list(get_cfg_default(), ["OPTIM.LR"])


def test_yaml_file_merge_and_errors(tmp_path):
    cfg = get_cfg_default()
    merge_from_file(cfg, osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml"))
    assert cfg.OPTIM.NAME == "sgd" and cfg.OPTIM.LR == 0.002 and cfg.OPTIM.MAX_EPOCH == 200
    assert cfg.OPTIM.WARMUP_CONS_LR == 1e-5 and cfg.INPUT.SIZE == (224, 224)
    assert cfg.TRAINER.COOP.CTX_INIT == "a photo of a" and cfg.TRAINER.COOP.N_CTX == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("OPTIM:\n  NAMEE: sgd\n")
    with pytest.raises(ConfigError, match=r"'OPTIM.NAMEE' in config file .*bad.yaml"):
        merge_from_file(cfg, str(bad))
    with pytest.raises(ConfigError, match="not found"):
        merge_from_file(cfg, str(tmp_path / "none.yaml"))


def test_merge_order_cli_overrides_files():
    cfg = make_cfg(
        ["--seed", "0", "--root", "/data", "OPTIM.LR", "0.5"],
        config_file="configs/trainers/CoOp/vit_b16_ctxv1.yaml",
    )
    assert cfg.SEED == 0, "--seed 0 must be honoured"
    assert cfg.DATASET.ROOT == "/data" and cfg.OPTIM.LR == 0.5
    assert cfg.DATASET.NAME == "DescribableTextures"


def test_config_file_flag_forms():
    """--config-file takes YAML files (several, or repeated); KEY VALUE right after it are opts,
    as in CoOp's commands."""
    from engine.cli import build_parser, setup_cfg

    main = osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml")
    optim = osp.join(ROOT, "configs/optim/sample.yaml")
    p = build_parser()
    cfg = setup_cfg(p.parse_args(["--config-file", main, "OPTIM.LR", "0.5"]))
    assert cfg.OPTIM.LR == 0.5 and cfg.OPTIM.MAX_EPOCH == 200
    cfg = setup_cfg(p.parse_args(["--config-file", main, optim, "--seed", "0", "OPTIM.LR", "1"]))
    assert cfg.OPTIM.SAM.NAME == "sample" and cfg.SEED == 0 and cfg.OPTIM.LR == 1.0
    cfg = setup_cfg(p.parse_args(["--config-file", main, "--config-file", optim]))
    assert cfg.OPTIM.SAM.NAME == "sample" and cfg.OPTIM.NAME == "sgd"
