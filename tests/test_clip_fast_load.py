"""Reading CLIP weights cheaply without changing anything (engine/clip/skip_init.py, the reader
in engine/clip/model.py): a build whose generator state is recorded skips the random
initialisation, yet gives the same weights, the same generator state and the same logits as the
full build; checkpoints are mapped, legacy files and OpenAI's TorchScript archives still load."""

from __future__ import annotations

import json
import os

import open_clip
import pytest
import torch
from helpers import make_cfg
from open_clip.model import convert_weights_to_lp

from engine.clip import model as clip_model
from engine.clip import skip_init
from engine.clip.model import build_clip, load_clip, read_state_dict


def _cfg(tiny_clip, path=None):
    return make_cfg(
        ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", tiny_clip[0]]
        + ["MODEL.BACKBONE.PATH", path or tiny_clip[1]]
    )


def _loaded(cfg, precision, seed=1):
    """(model, generator state after load_clip, logits of fixed inputs) from a seeded start."""
    torch.manual_seed(seed)
    model = load_clip(cfg, precision=precision)
    after = torch.get_rng_state()
    img = torch.linspace(-1, 1, 2 * 3 * 32 * 32).reshape(2, 3, 32, 32)
    txt = open_clip.tokenize(["a dog", "a cat"])
    with torch.no_grad():
        img = img.to(model.visual.conv1.weight.dtype)
        logits = model(img, txt)[0] if precision == "fp32" else model.encode_text(txt)
    return model, after, logits


def _tensors(model):
    return {**dict(model.named_parameters()), **{f"b:{k}": v for k, v in model.named_buffers()}}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_recorded_build_gives_the_same_model_generator_and_logits(
    tiny_clip, tmp_path, monkeypatch, precision
):
    monkeypatch.setenv("SAMPLE_PL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_clip)
    # the reference: the full random initialisation, then the weights (what load_clip did)
    with open(tiny_clip[0]) as f:
        model_cfg = json.load(f)
    torch.manual_seed(1)
    ref = build_clip(model_cfg, precision)
    ref_after = torch.get_rng_state()

    before = dict(skip_init.builds)
    first, after1, logits1 = _loaded(cfg, precision)
    assert skip_init.builds["full"] == before["full"] + 1
    assert len(os.listdir(skip_init.cache_dir())) == 1  # the record
    second, after2, logits2 = _loaded(cfg, precision)
    assert skip_init.builds["recorded"] == before["recorded"] + 1  # no random fills this time
    assert torch.equal(after1, ref_after) and torch.equal(after2, ref_after)
    ref.load_state_dict(read_state_dict(tiny_clip[1])[0])  # the weights copied in, as before
    if precision == "fp16":
        convert_weights_to_lp(ref, dtype=torch.float16)
    a, b, r = _tensors(first), _tensors(second), _tensors(ref)
    assert a.keys() == b.keys() == r.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == r[k].dtype, k
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], r[k]), k
        assert a[k].is_contiguous() == r[k].is_contiguous(), k
    assert torch.equal(logits1, logits2)
    # what is drawn after the build (a prompt learner's vectors) is drawn from the same state
    torch.set_rng_state(after2)
    drawn = torch.randn(4, 8)
    torch.set_rng_state(ref_after)
    assert torch.equal(drawn, torch.randn(4, 8))


def test_another_seed_records_another_state_and_a_damaged_record_is_rebuilt(
    tiny_clip, tmp_path, monkeypatch
):
    monkeypatch.setenv("SAMPLE_PL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(tiny_clip)
    _, after1, _ = _loaded(cfg, "fp32", seed=1)
    _, after2, _ = _loaded(cfg, "fp32", seed=2)
    assert not torch.equal(after1, after2)
    records = sorted(os.listdir(skip_init.cache_dir()))
    assert len(records) == 2
    for name in records:  # damaged records: ignored, the full build runs and records again
        with open(os.path.join(skip_init.cache_dir(), name), "r+b") as f:
            f.write(b"\0" * 64)
    full = skip_init.builds["full"]
    _, again, _ = _loaded(cfg, "fp32", seed=1)
    assert skip_init.builds["full"] == full + 1 and torch.equal(again, after1)
    _, again, _ = _loaded(cfg, "fp32", seed=1)
    assert torch.equal(again, after1)


def test_checkpoints_are_mapped_and_legacy_files_still_load(tiny_clip, tmp_path):
    sd, is_jit = read_state_dict(tiny_clip[1])
    assert not is_jit
    with open("/proc/self/maps") as f:  # mapped, not read into memory
        assert os.path.realpath(tiny_clip[1]) in f.read()
    legacy = str(tmp_path / "legacy.pt")
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    old, _ = read_state_dict(legacy)
    assert old.keys() == sd.keys() and all(torch.equal(old[k], sd[k]) for k in sd)
    a, b = load_clip(_cfg(tiny_clip)), load_clip(_cfg(tiny_clip, legacy))
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    # a single run's fp32 model holds the mapped pages themselves (no copy) ...
    assert _in_mapping(a.visual.conv1.weight, tiny_clip[1])
    assert not _in_mapping(b.visual.conv1.weight, tiny_clip[1])
    # ... and a process that keeps the weights for later runs copies them
    clip_model.cache_weights(True)
    try:
        kept = load_clip(_cfg(tiny_clip))
    finally:
        clip_model.cache_weights(False)
    assert not _in_mapping(kept.visual.conv1.weight, tiny_clip[1])
    assert torch.equal(kept.visual.conv1.weight, a.visual.conv1.weight)


def _in_mapping(tensor, path) -> bool:
    """Whether ``tensor``'s data lies in a memory mapping of the file ``path``."""
    ptr = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(os.path.realpath(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


@pytest.mark.slow
def test_the_startup_benchmark_measures_fresh_processes_with_and_without_the_record():
    """tools/benchmark.py --startup on the tiny CLIP: fresh train.py processes whose start-up
    phases come from their cost.json; the first records its CLIP build, the second finds it."""
    from engine.clip.toy import TINY_CLIP_CONFIG
    from experiments.benchmark_startup import print_startup_costs, startup_costs

    result = startup_costs(repeats=2, model_cfg=TINY_CLIP_CONFIG, image_size=32)
    assert [r["clip_build"] for r in result["runs"]] == ["full", "recorded"]
    for run in result["runs"]:
        assert sum(run["phases"].values()) == pytest.approx(run["time_to_first_step_s"], abs=0.01)
        assert run["phases"]["imports"] > 0 and run["phases"]["clip weights"] > 0
        assert run["time_to_first_step_s"] < run["wall_s"] < run["outside_s"]
    for groups in result["imports"]:
        assert groups["torch"] > 0 and groups["engine"] > 0
        assert groups["total"] == pytest.approx(
            sum(v for k, v in groups.items() if k != "total"), abs=0.01
        )
    assert result["cost_json"]["startup"]["phases"] == pytest.approx(
        result["runs"][-1]["phases"], abs=1e-3
    )
    print_startup_costs(result)
