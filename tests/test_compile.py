"""MODEL.COMPILE: compiled encoders give the results of the eager ones (CPU: aot_eager backend,
which traces with dynamo and AOT autograd as the GPU modes do, without code generation)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cfg

from engine import build_trainer
from engine.clip.toy import TINY_CLIP_CONFIG, write_tiny_clip
from engine.compile import check_compile_option


@pytest.fixture(scope="module")
def deep_clip_opts(tmp_path_factory):
    import copy

    from engine.clip.toy import TINY_OPTS

    config = copy.deepcopy(TINY_CLIP_CONFIG)
    config["text_cfg"]["layers"] = config["vision_cfg"]["layers"] = 3
    cfg_path, ckpt = write_tiny_clip(str(tmp_path_factory.mktemp("deep")), config)
    return ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path,
            "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]  # fmt: skip


EXTRA = {
    "CoOp": ["TRAINER.COOP.PREC", "fp32", "TRAINER.COOP.N_CTX", "4"],
    "TCP": ["TRAINER.TCP.PREC", "fp32", "TRAINER.TCP.INJECT_LAYER", "1"],
    "MaPLe": ["TRAINER.MAPLE.PREC", "fp32", "TRAINER.MAPLE.PROMPT_DEPTH", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", sorted(EXTRA))
def test_compiled_step_and_evaluation_match_eager(trainer, tmp_path, dtd_root, deep_clip_opts):
    results = {}
    for mode in ("", "aot_eager"):
        cfg = make_cfg(
            ["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path / (mode or "eager")),
             *deep_clip_opts, *EXTRA[trainer], "OPTIM.NAME", "sgd", "OPTIM.LR", "0.01",
             "OPTIM.SAM.NAME", "sample", "DATASET.NUM_SHOTS", "2", "MODEL.COMPILE", mode,
             "TEST.FEATURE_CACHE", "False"],
            trainer=trainer,
        )  # fmt: skip
        tr = build_trainer(cfg)
        compiled = [n for n, m in tr.model.named_modules() if getattr(m, "_compiled", False)]
        assert bool(compiled) == bool(mode), compiled
        batch = next(iter(tr.train_loader_x))
        tr.batch_idx = 0
        out = tr.forward_backward(batch)
        params = [p.detach().clone() for p in tr.get_model(tr.get_model_names()[0]).parameters()]
        acc = tr.test()
        results[mode] = (float(out["loss"]), params, acc)
    (l1, p1, a1), (l2, p2, a2) = results[""], results["aot_eager"]
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6) and a1 == a2
    for x, y in zip(p1, p2):
        assert torch.allclose(x, y, atol=1e-6)


def test_bad_compile_value():
    with pytest.raises(ValueError, match="MODEL.COMPILE must be empty or one of"):
        check_compile_option("fast")
    cfg = make_cfg(["MODEL.COMPILE", "fast"])
    assert cfg.MODEL.COMPILE == "fast"  # a string key; the trainer rejects the value
