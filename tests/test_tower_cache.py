"""CLIP towers kept by a packed worker (engine/clip/tower_cache.py): a copy equals a fresh build
bit for bit, leaves torch's generator where the build leaves it, and is the run's own."""

from __future__ import annotations

import pytest
import torch

from engine.clip import model as clip_model
from engine.clip import tower_cache
from engine.clip.toy import shrunk_config, write_tiny_clip


@pytest.fixture
def caches_on():
    clip_model.cache_weights(True)
    tower_cache.cache_towers(True)
    yield
    clip_model.cache_weights(False)
    tower_cache.cache_towers(False)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Config and checkpoint of the tiny ViT and of a tiny ResNet (RN50's shape)."""
    vit = write_tiny_clip(str(tmp_path_factory.mktemp("vit")))
    rn = write_tiny_clip(str(tmp_path_factory.mktemp("rn")), shrunk_config("RN50", True)[0])
    return {"vit": vit, "rn": rn}


def backbone_cfg(paths, pretrained: bool = True):
    from engine.config import get_cfg_default

    cfg = get_cfg_default()
    bb = cfg.MODEL.BACKBONE
    bb.NAME, bb.CONFIG, bb.PATH, bb.PRETRAINED = "", paths[0], paths[1], pretrained
    return cfg


def snapshot(model: torch.nn.Module) -> dict:
    """Every tensor's values, dtype, layout and requires_grad, and every module's mode."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t.detach().clone(), t.dtype, t.stride(), t.requires_grad)
    out["modes"] = [(n, m.training) for n, m in model.named_modules()]
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "modes":
            assert a[k] == b[k]
        else:
            assert torch.equal(a[k][0], b[k][0]) and a[k][1:] == b[k][1:], k


def load(cfg, seed: int, precision: str):
    """``load_clip`` after seeding and a few draws; (snapshot, generator state, next draws)."""
    torch.manual_seed(seed)
    torch.rand(5)
    model = clip_model.load_clip(cfg, precision)
    state = torch.get_rng_state()
    return model, snapshot(model), state, torch.rand(7)


@pytest.mark.parametrize("arch,precision", [("vit", "fp32"), ("vit", "fp16"), ("rn", "fp32")])
def test_a_copied_tower_is_a_fresh_build_and_the_generator_ends_in_the_same_state(
    clips, caches_on, arch, precision
):
    cfg = backbone_cfg(clips[arch])
    fresh = {}
    tower_cache.cache_towers(False)  # the reference: built every time
    for seed in (0, 3):
        fresh[seed] = load(cfg, seed, precision)[1:]
    tower_cache.cache_towers(True)
    built, copied = tower_cache.stats["built"], tower_cache.stats["copied"]
    for seed in (0, 3, 0):  # the first builds and keeps the tower, the others copy it
        _, snap, state, draws = load(cfg, seed, precision)
        assert_same(snap, fresh[seed][0])
        assert torch.equal(state, fresh[seed][1])  # byte for byte
        assert torch.equal(draws, fresh[seed][2])
    assert (tower_cache.stats["built"], tower_cache.stats["copied"]) == (built + 1, copied + 2)


def test_a_run_that_changes_its_tower_changes_nobody_elses(clips, caches_on):
    cfg = backbone_cfg(clips["vit"])
    model, before, _, _ = load(cfg, 1, "fp32")
    with torch.no_grad():  # as a trainer fine-tuning CLIP's weights (SkipTuning, MMRL) does
        for p in model.parameters():
            p.add_(1.0)
    model.requires_grad_(True)
    model.train()
    assert_same(load(cfg, 1, "fp32")[1], before)


def test_a_changed_checkpoint_is_built_again(clips, caches_on, tmp_path):
    cfg_path, ckpt = write_tiny_clip(str(tmp_path), seed=5)
    cfg = backbone_cfg((cfg_path, ckpt))
    first = load(cfg, 0, "fp32")[1]
    write_tiny_clip(str(tmp_path), seed=6)  # the same file names, other weights
    built = tower_cache.stats["built"]
    second = load(cfg, 0, "fp32")[1]
    assert tower_cache.stats["built"] == built + 1
    assert not torch.equal(first["visual.conv1.weight"][0], second["visual.conv1.weight"][0])


def test_random_weight_towers_are_copied_only_for_the_same_generator_state(clips, caches_on):
    cfg = backbone_cfg(clips["vit"], pretrained=False)
    tower_cache.cache_towers(False)
    fresh = {seed: load(cfg, seed, "fp32")[1:] for seed in (0, 1)}
    tower_cache.cache_towers(True)
    built, copied = tower_cache.stats["built"], tower_cache.stats["copied"]
    for seed in (0, 1, 0):
        _, snap, state, draws = load(cfg, seed, "fp32")
        assert_same(snap, fresh[seed][0])
        assert torch.equal(state, fresh[seed][1]) and torch.equal(draws, fresh[seed][2])
    assert (tower_cache.stats["built"], tower_cache.stats["copied"]) == (built + 2, copied + 1)


@pytest.mark.parametrize("n", [0, 1, 623, 624, 625, 1248, 5000])
def test_draws_are_counted_and_replayed_as_torch_draws_them(n):
    torch.manual_seed(11)
    torch.rand(100)
    before = torch.get_rng_state()
    torch.empty(n).uniform_()  # one 32-bit draw per float32 element
    after = torch.get_rng_state()
    assert tower_cache.draws_between(before, after, limit=10_000) == n
    assert torch.equal(tower_cache.advance(before, n), after)
    if n:  # no count of draws goes back
        assert tower_cache.draws_between(after, before, limit=10_000) is None


def test_a_state_seen_before_is_advanced_without_drawing_again(monkeypatch):
    torch.manual_seed(21)
    before = torch.get_rng_state()
    torch.empty(3000).uniform_()
    after = torch.get_rng_state()
    first = tower_cache.advance(before, 3000)
    calls = []
    monkeypatch.setattr(tower_cache, "_generator", lambda *a: calls.append(a))  # no new draws
    again = tower_cache.advance(before, 3000)
    assert torch.equal(first, after) and torch.equal(again, after) and not calls
    again.zero_()  # each caller's own tensor
    assert torch.equal(tower_cache.advance(before, 3000), after)


def test_a_cached_normal_sample_is_not_replayed():
    torch.manual_seed(0)
    torch.randn(3)  # fewer than 16 values: torch keeps the pair's second sample
    state = torch.get_rng_state()
    assert tower_cache.advance(state, 10) is None
    assert tower_cache.draws_between(state, state, limit=10) is None


def test_a_build_whose_draws_cannot_be_replayed_is_built_every_time(clips, caches_on, monkeypatch):
    cfg = backbone_cfg(clips["vit"])
    tower_cache.cache_towers(False)
    fresh = load(cfg, 2, "fp32")[1:]
    tower_cache.cache_towers(True)
    build = clip_model.clip_from_state_dict

    def scalar_normal_too(*args, **kwargs):  # leaves torch's cached normal sample behind
        model = build(*args, **kwargs)
        torch.randn(1)
        return model

    monkeypatch.setattr(clip_model, "clip_from_state_dict", scalar_normal_too)
    built, copied = tower_cache.stats["built"], tower_cache.stats["copied"]
    for _ in range(2):
        torch.manual_seed(2)
        torch.rand(5)
        clip_model.load_clip(cfg, "fp32")
    assert (tower_cache.stats["built"], tower_cache.stats["copied"]) == (built + 2, copied)
    assert not tower_cache._TOWERS and len(tower_cache._UNREPLAYABLE) == 1
    monkeypatch.setattr(clip_model, "clip_from_state_dict", build)
    assert_same(load(cfg, 2, "fp32")[1], fresh[0])  # built again, still not kept
