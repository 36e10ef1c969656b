"""Every optimisation gives the same numbers as the work it saves (issue 8).

- prompt truncation: each trainer built with full 77-token prompts (the reference code bases)
  gives bit-identical losses, updates and evaluation logits;
- frozen work once per step: each trainer's step equals the reference style that runs
  ``prepare_step`` (image encoder, teachers) again inside every pass of a two-pass optimizer;
- no host-device synchronisation in any trainer's step;
- decoded-image cache: real-size JPEGs through the published training pipelines, fully and
  partly cached, give the batches of decoding every epoch (extends tests/test_caches.py);
- evaluation-feature cache: zero-shot CLIP and TCP predict the same from cached features, and
  every part of the cache key (split, dataset, device, ...) invalidates it (extends
  tests/test_caches.py, which covers CoOp, transforms, image lists, precision and weights).
Batched CoCoOp against its per-image loop: tests/test_cocoop.py.
"""

from __future__ import annotations

import copy
import os
import os.path as osp
import sys

import pytest
import torch
from conftest import make_cfg
from torch.overrides import TorchFunctionMode

from engine import build_trainer
from engine.clip.text import truncate_tokens
from engine.clip.toy import TINY_CLIP_CONFIG, TINY_OPTS, write_tiny_clip
from engine.data import DataManager
from engine.feature_cache import FeatureCache, cache_key
from engine.registry import TRAINER_REGISTRY
from tools.benchmark import make_jpeg_dataset, reference_style, trainer_config_file

TRAINERS = ["CoOp", "CoCoOp", "TCP", "MaPLe", "CoPrompt"]
FULL_LENGTH = ("MODEL.TEXT_FULL_LENGTH", "True")  # the reference code bases' 77-token prompts
# 9 blocks per tower: MaPLe/CoPrompt prompt 9 blocks, TCP injects before text block 8
DEEP_CLIP = copy.deepcopy(TINY_CLIP_CONFIG)
DEEP_CLIP["vision_cfg"]["layers"] = DEEP_CLIP["text_cfg"]["layers"] = 9


def _registered(name: str):
    import trainers  # noqa: F401

    if name not in TRAINER_REGISTRY:
        pytest.skip(f"trainer {name} is not registered")


@pytest.fixture(scope="module")
def deep_opts(tmp_path_factory):
    cfg_path, ckpt = write_tiny_clip(str(tmp_path_factory.mktemp("deep_clip")), config=DEEP_CLIP)
    return ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path,
            "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]  # fmt: skip


def _cfg(trainer, root, out, deep_opts, optim="", *extra):
    """The trainer's base-to-new config on the deep tiny CLIP (fp32), with the paper's values of
    ``optim`` in its sharpness-aware stage."""
    opts = ["--root", root, "--seed", "1", "--output-dir", str(out)]
    if optim:
        opts += ["--optim-config-file", osp.join("configs", "optim", trainer, f"{optim}.yaml")]
    node = f"TRAINER.{trainer.upper()}"
    opts += [*deep_opts, f"{node}.PREC", "fp32", "DATASET.NUM_SHOTS", "2", "OPTIM.MAX_EPOCH", "1"]
    opts += ["OPTIM.WARMUP_EPOCH", "0"]  # the configs' LR, not the 1e-5 warm-up
    if trainer == "CoPrompt":
        opts += [f"{node}.FALLBACK_TEMPLATES", "True"]
    return make_cfg([*opts, *extra], trainer=trainer, config_file=trainer_config_file(trainer))


def _start(tr):
    """What the engine does before the first step (CoPrompt's teacher texts, staged freeze)."""
    tr.before_train()
    tr.batch_idx = 0
    tr.epoch = tr.optim_step.staging.start_epoch  # the sharpness-aware stage (staged: stage 2)
    tr.before_epoch()
    return tr


def _learnable(tr) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{k}": v.detach().clone()
        for name in tr.get_model_names()
        for k, v in tr.get_model(name).state_dict().items()
    }


def _assert_same_step(tr_a, tr_b, batch) -> dict:
    out_a, out_b = tr_a.forward_backward(batch), tr_b.forward_backward(batch)
    for key in ("loss", "grad_norm", "grad_p_norm"):
        if key in out_a:
            assert torch.equal(out_a[key], out_b[key]), key
    a, b = _learnable(tr_a), _learnable(tr_b)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return out_a


@pytest.mark.parametrize("trainer", TRAINERS)
def test_truncated_prompts_give_identical_steps_and_logits(trainer, tmp_path, dtd_root, deep_opts):
    _registered(trainer)
    cfg = _cfg(trainer, dtd_root, tmp_path / "o", deep_opts, "sample")
    short = _start(build_trainer(cfg))
    cfg_full = _cfg(trainer, dtd_root, tmp_path / "o", deep_opts, "sample", *FULL_LENGTH)
    full = _start(build_trainer(cfg_full))
    pl_short, pl_full = short.model.prompt_learner, full.model.prompt_learner
    assert pl_short.token_prefix.shape[1] + pl_short.token_suffix.shape[1] + pl_short.n_ctx < 77
    assert pl_full.token_prefix.shape[1] + pl_full.token_suffix.shape[1] + pl_full.n_ctx == 77
    batch = next(iter(short.train_loader_x))
    out = _assert_same_step(short, full, batch)
    assert "grad_norm" in out  # a two-pass step ran
    images, _ = short.parse_batch_test(next(iter(short.test_loader)))
    logits = []
    with torch.no_grad():
        for tr in (short, full):
            tr.set_model_mode("eval")
            tr.before_test()
            logits.append(tr.model_inference(images))
            tr.close_writer()
    assert torch.equal(*logits)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_frozen_work_once_per_step_equals_recomputing_it_in_both_passes(
    trainer, tmp_path, dtd_root, deep_opts
):
    _registered(trainer)
    cfg = _cfg(trainer, dtd_root, tmp_path / "o", deep_opts, "sample")
    once = _start(build_trainer(cfg))
    base, calls = TRAINER_REGISTRY.get(trainer), []

    def prepare_step(self, inputs):  # the trainer's own, counted
        calls.append(1)
        return base.prepare_step(self, inputs)

    counted = type(trainer, (base,), {"prepare_step": prepare_step})
    both = _start(reference_style(counted)(cfg))
    batch = next(iter(once.train_loader_x))
    for step in range(2):  # the second step also uses SAMPLe's moving average
        once.batch_idx = both.batch_idx = step
        _assert_same_step(once, both, batch)
    assert len(calls) == 4  # the reference style runs it in both passes of both steps
    for tr in (once, both):
        tr.close_writer()


SYNC_METHODS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
    "nonzero", "unique", "masked_select", "equal", "allclose",
}  # fmt: skip
# a CPU-generator draw (torch.randint without a device): reading it never waits for the GPU
ALLOWED_SYNC_SITES = {("trainers/coprompt.py", "draw_description_index")}


class SyncRecorder(TorchFunctionMode):
    """Records the repository call site of every tensor read that waits for the device."""

    def __init__(self):
        super().__init__()
        self.sites: set[tuple[str, str]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        # torch's optimizers read only their CPU step counters (Adam's bias correction)
        in_torch_optim = f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename
        if getattr(func, "__name__", "") in SYNC_METHODS and not in_torch_optim:
            root = osp.dirname(osp.dirname(osp.abspath(__file__)))
            while frame is not None and not frame.f_code.co_filename.startswith(root):
                frame = frame.f_back
            if frame is not None:
                path = osp.relpath(frame.f_code.co_filename, root)
                self.sites.add((path, frame.f_code.co_name))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optim", ["", "sample"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_training_step_has_no_host_device_sync(trainer, optim, tmp_path, dtd_root, deep_opts):
    """The engine reads losses and diagnostics only at the print frequency; the amp path's
    GradScaler checks are the one deliberate exception (not tested here)."""
    _registered(trainer)
    tr = _start(build_trainer(_cfg(trainer, dtd_root, tmp_path / "o", deep_opts, optim)))
    batch = next(iter(tr.train_loader_x))
    tr.forward_backward(batch)  # lazily created state (momentum, moving averages)
    with SyncRecorder() as rec:
        torch.ones(2).sum().item()  # the recorder sees a read
    assert rec.sites == {
        ("tests/test_performance.py", "test_training_step_has_no_host_device_sync")
    }
    with SyncRecorder() as rec:
        tr.forward_backward(batch)
    tr.close_writer()
    assert rec.sites <= ALLOWED_SYNC_SITES


def test_full_length_is_an_argument_of_the_cut():
    tokens = torch.zeros(2, 77, dtype=torch.long)
    tokens[:, 5] = 49407  # EOT
    assert truncate_tokens(tokens)[0].shape[1] == 16
    cut, eot = truncate_tokens(tokens, full_length=True)
    assert torch.equal(cut, tokens) and eot.tolist() == [5, 5]
    assert truncate_tokens(tokens)[0].shape[1] == 16  # nothing is left switched on


# ----------------------------------------------------------------------------------------------
# Decoded-image cache on real-size JPEGs (tests/test_caches.py: tiny images, one pipeline)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    from types import SimpleNamespace

    root = str(tmp_path_factory.mktemp("jpegs"))
    s = SimpleNamespace(loader_classes=3, loader_per_class=4, cache_test_images=6)
    return make_jpeg_dataset(root, s)


PIPELINES = {  # the published training transforms and their number of views
    "coop": (["random_resized_crop", "random_flip", "normalize"], 1),
    "coprompt": (["randaugment", "normalize"], 2),
}


def _epochs(jpeg_root, pipeline, cache, budget_mb="4096", workers="0", epochs=2):
    transforms, views = PIPELINES[pipeline]
    cfg = make_cfg(
        ["--root", jpeg_root, "--seed", "3", "INPUT.SIZE", "(224, 224)",
         "INPUT.INTERPOLATION", "bicubic", "INPUT.TRANSFORMS", str(transforms),
         "DATALOADER.K_TRANSFORMS", str(views), "DATALOADER.NUM_WORKERS", workers,
         "DATALOADER.TRAIN_X.BATCH_SIZE", "5", "DATASET.NUM_SHOTS", "4",
         "DATALOADER.CACHE_DECODED", str(cache), "DATALOADER.CACHE_DECODED_MB", budget_mb]
    )  # fmt: skip
    dm = DataManager(cfg)
    dm.cache_training_images()
    loader, out = dm.train_loader_x, []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for b in loader:
            views_ = b["img"] if isinstance(b["img"], list) else [b["img"]]
            out.append((b["index"], views_))
    return loader.dataset.images, out


@pytest.mark.parametrize(
    "pipeline, budget_mb, n_cached",
    [("coop", "4096", 12), ("coprompt", "4096", 12), ("coop", "2", 3)],  # 2 MB: 3 of 12 JPEGs
)
def test_decoded_cache_gives_identical_batches_on_real_jpegs(
    jpeg_root, pipeline, budget_mb, n_cached
):
    images, cached = _epochs(jpeg_root, pipeline, True, budget_mb)
    assert len(images) == n_cached
    decoded_images = [images.get(i) for i in range(12) if images.get(i) is not None]
    assert decoded_images[0].shape == (3, 375, 500) and decoded_images[0].dtype == torch.uint8
    _, decoded = _epochs(jpeg_root, pipeline, False)
    assert len(cached) == len(decoded) > 2
    for (i1, v1), (i2, v2) in zip(cached, decoded):
        assert torch.equal(i1, i2) and len(v1) == len(v2)
        for a, b in zip(v1, v2):
            assert a.shape[-2:] == (224, 224) and torch.equal(a, b)
    first, second = cached[0][1][0], cached[len(cached) // 2][1][0]
    assert not torch.equal(first, second)  # augmentation differs across epochs


def test_seeded_sample_equals_seeding_the_global_generator(jpeg_root):
    """Per-sample seeding touches only the CPU generator, with the result of torch.manual_seed,
    and leaves the caller's random state alone."""
    cfg = make_cfg(["--root", jpeg_root, "--seed", "3", "INPUT.SIZE", "(224, 224)",
                    "INPUT.INTERPOLATION", "bicubic", "DATASET.NUM_SHOTS", "4",
                    "DATALOADER.NUM_WORKERS", "0"])  # fmt: skip
    dm = DataManager(cfg)
    wrapper = dm.train_loader_x.dataset
    torch.manual_seed(123)
    state = torch.get_rng_state()
    got = wrapper[(0, 987)]["img"]
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(987)
    want = dm.tfm_train(wrapper.load(0))
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# Evaluation-feature cache (tests/test_caches.py: CoOp and the transform/list/precision/weights)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer", ["ZeroshotCLIP", "TCP"])
def test_cached_features_give_the_predictions_of_images(trainer, tmp_path, dtd_root, deep_opts):
    cache_dir = tmp_path / "cache"
    if trainer == "TCP":
        cfg = _cfg("TCP", dtd_root, tmp_path / "o", deep_opts, "", "TEST.FEATURE_CACHE_DIR",
                   str(cache_dir))  # fmt: skip
    else:
        cfg = make_cfg(["--root", dtd_root, "--output-dir", str(tmp_path / "o"), *deep_opts,
                        "TRAINER.ZEROSHOTCLIP.PREC", "fp32", "TEST.FEATURE_CACHE_DIR",
                        str(cache_dir)], trainer=trainer)  # fmt: skip
    preds = []
    for route in ("computed", "loaded", "images"):
        tr = build_trainer(cfg)
        if route == "images":
            tr.frozen_image_encoder = lambda: None
        tr.test()
        preds.append(torch.cat(tr.evaluator._preds))
        assert len(os.listdir(cache_dir)) == 1
    assert torch.equal(preds[0], preds[1]) and torch.equal(preds[0], preds[2])


def test_every_part_of_the_cache_key_invalidates(tmp_path, dtd_root, tiny_clip_opts):
    parts = dict(weights="a" * 40, precision="fp16", device="cuda", dataset="DTD",
                 split="test", data="b" * 40, transform="Compose(...)")  # fmt: skip
    keys = {cache_key(**parts)}
    for name in parts:
        keys.add(cache_key(**{**parts, name: parts[name] + "x"}))
    assert len(keys) == 1 + len(parts)
    # through the engine: another split and another dataset name give new files
    cache_dir = tmp_path / "cache"
    cfg = make_cfg(["--root", dtd_root, "--output-dir", str(tmp_path / "o"), *tiny_clip_opts,
                    "TRAINER.COOP.PREC", "fp32", "DATASET.NUM_SHOTS", "2",
                    "TEST.FEATURE_CACHE_DIR", str(cache_dir)])  # fmt: skip
    tr = build_trainer(cfg)
    tr.test(split="test")
    tr.test(split="val")
    assert len(os.listdir(cache_dir)) == 2
    encoder = tr.frozen_image_encoder()
    other = cfg.clone()
    other.defrost()
    other.DATASET.NAME = "OtherTextures"
    tr.cfg = other
    tr._eval_features(encoder, tr.test_loader, "test")
    assert len(os.listdir(cache_dir)) == 3


def test_unreadable_cache_file_is_recomputed(tmp_path, dtd_root, tiny_clip_opts):
    cache_dir = tmp_path / "cache"
    cfg = make_cfg(["--root", dtd_root, "--seed", "1", "--output-dir", str(tmp_path / "o"),
                    *tiny_clip_opts, "TRAINER.COOP.PREC", "fp32", "DATASET.NUM_SHOTS", "2",
                    "TEST.FEATURE_CACHE_DIR", str(cache_dir)])  # fmt: skip
    tr = build_trainer(cfg)
    acc = tr.test()
    (path,) = [osp.join(cache_dir, f) for f in os.listdir(cache_dir)]
    with open(path, "wb") as f:
        f.write(b"not a tensor file")
    assert FeatureCache(str(cache_dir)).load(osp.basename(path)[:-3]) is None
    assert build_trainer(cfg).test() == acc
    assert FeatureCache(str(cache_dir)).load(osp.basename(path)[:-3]) is not None
