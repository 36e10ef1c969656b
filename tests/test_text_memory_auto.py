"""MODEL.TEXT_MEMORY auto (engine/clip/text_memory.py): the estimate against the measured budget
table, the choice rule per device, and the choice applied to a built model (free memory
injected)."""

from __future__ import annotations

import pytest
from conftest import make_cfg

from engine import build_trainer
from engine.clip import text_memory as tm
from engine.clip.text import TextEncoder, TextOptions
from engine.errors import ConfigError

GIB = 2**30


def test_estimate_matches_the_measured_budget_table():
    """docs/backbones.md: CoOp at 1,000 classes (16 tokens, width 128, 9 blocks, fp32) keeps
    1,101 MiB in a plain step, almost all of it the text activations."""
    estimate = tm.text_bytes(1000, 16, 128, 9, 4) / 2**20
    assert 0.9 * 1101 < estimate < 1.1 * 1101


def test_the_fastest_variant_that_fits():
    plain, prompts = 4 * GIB, 1000
    need = tm.variant_bytes(plain, prompts, 100)
    assert need[tm.CKPT] == pytest.approx(0.4 * GIB)
    assert need[tm.SHARED_CKPT] < need[tm.CKPT] < need[tm.SHARED] < need[tm.PLAIN]

    def pick(free_gib, device="cuda"):
        return tm.choose(plain, prompts, free_gib * GIB, device)[0]

    assert pick(80) == tm.PLAIN  # a GPU with room: plain is the fastest there
    assert pick(4) == tm.SHARED  # 0.8 x 4 = 3.2 GiB: not plain (4), the shared prefix (2.6)
    assert pick(1) == tm.SHARED_CKPT
    variant, why = tm.choose(plain, prompts, 0.1 * GIB, "cuda")
    assert variant == tm.SHARED_CKPT and "does not fit" in why
    assert pick(80, "cpu") == tm.SHARED  # on CPU the shared prefix is the fastest
    assert tm.options_of(tm.SHARED_CKPT, 50) == TextOptions(50, True, True)


@pytest.mark.parametrize(
    ("free", "want"), [(1e12, TextOptions(shared_prefix=True)), (1.0, TextOptions(3, True, True))]
)
def test_auto_configures_the_built_model(monkeypatch, tiny_clip_opts, free, want):
    monkeypatch.setattr(tm, "free_memory", lambda device: free)
    opts = [*tiny_clip_opts, "MODEL.TEXT_MEMORY", "auto", "MODEL.TEXT_CHUNK", "3"]
    tr = build_trainer(make_cfg(["TRAINER.COOP.PREC", "fp32", *opts]), classnames=list("abcdefg"))
    encoders = [m for m in tr.model.modules() if isinstance(m, TextEncoder)]
    assert encoders and all(m.options == want for m in encoders)
    assert tm.model_text_shape(tr.model)[0] == 7  # 7 class prompts


def test_auto_config_errors():
    from engine.clip.text import text_options

    with pytest.raises(ConfigError, match="MODEL.TEXT_MEMORY must be"):
        text_options(make_cfg(["MODEL.TEXT_MEMORY", "fast"]))
    with pytest.raises(ConfigError, match="leave them False"):
        text_options(make_cfg(["MODEL.TEXT_MEMORY", "auto", "MODEL.SHARED_PREFIX", "True"]))
    assert text_options(make_cfg(["MODEL.TEXT_MEMORY", "auto"])) == TextOptions()  # no model
