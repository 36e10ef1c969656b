"""INPUT.PIPELINE tensor_device: the worker draws tensor's crop boxes and flips and sends the crop
region; the device's resize and flip give tensor's batches (bit for bit on a CPU device); other
training transforms are refused; train.py trains with it."""

from __future__ import annotations

import math
import os.path as osp

import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from conftest import make_cfg
from test_loader_pipeline import COOP, epoch_batches, input_cfg, jpegs, loader_opts  # noqa: F401

from engine.data import DataManager, build_transform, read_image
from engine.data.device_crop import (
    CropBatch,
    DeviceCrop,
    DeviceCropFinish,
    collate_crops,
    memory_order,
)
from engine.data.device_finish import FinishingLoader, device_finish_of
from engine.errors import ConfigError

CPU = torch.device("cpu")


def draws(tfm, img, seed: int):
    torch.manual_seed(seed)
    out = tfm(img)
    return out, torch.rand(3)  # the generator's state after the transform: same draws, same state


@pytest.mark.parametrize("transforms", [COOP, ["random_resized_crop", "normalize"]])
def test_same_crop_boxes_flips_and_pixels_as_tensor(jpegs, transforms):  # noqa: F811
    """Seed for seed: the crop region is tensor's RandomResizedCrop box, the flip flag its
    RandomHorizontalFlip draw (the generator ends in the same state), and the device's resize
    and flip of the batch give tensor's uint8 images to the last bit (CPU: the same kernel on the
    same uint8 crop; tolerance 0)."""
    tensor = build_transform(input_cfg("tensor", transforms=transforms), True, on_device=True)
    device = build_transform(
        input_cfg("tensor_device", transforms=transforms), True, on_device=True
    )
    finish = device_finish_of(device)
    assert isinstance(finish, DeviceCropFinish)
    rrc = next(t for t in tensor.transforms if isinstance(t, T.RandomResizedCrop))
    flips, crops, want = [], [], []
    for path in jpegs:
        img = read_image(path)
        for seed in range(12):
            ref, state_ref = draws(tensor, img, seed)
            crop, state = draws(device, img, seed)
            assert isinstance(crop, DeviceCrop) and crop.img.dtype == torch.uint8
            assert torch.equal(state, state_ref)
            torch.manual_seed(seed)
            box = rrc.make_params([T.ToImage()(img)])
            assert torch.equal(crop.img, TF.crop(T.ToImage()(img), **box).as_subclass(torch.Tensor))
            flips.append(crop.flip)
            crops.append({"img": crop, "label": seed})
            want.append(ref)
    batch = collate_crops(crops)
    assert isinstance(batch["img"], CropBatch) and batch["label"].tolist() == list(range(12)) * 3
    got = finish.resize(batch["img"], CPU)
    assert torch.equal(got, torch.stack(want))
    # a GPU resizes uint8 in float and rounds (torchvision); against the CPU's uint8 kernel that
    # is a grey level on some values (the CPU's fixed-point filter weights round differently):
    # the bound the benchmark measures at 224x224 (max 3 levels, mean 0.19)
    crops = batch["img"]
    as_float = CropBatch(crops.flat.float(), crops.shapes, crops.flip, orders=crops.orders)
    levels = (finish.resize(as_float, CPU).round().clamp(0, 255) - got).abs()
    assert levels.max() <= 4 and levels.mean() < 0.5
    assert any(flips) == ("random_flip" in transforms) and not all(flips)
    # the float, normalised batch: tensor's device finish of those images
    assert torch.equal(finish(batch, CPU)["img"], device_finish_of(tensor)(got, CPU))


def test_loader_yields_the_tensor_pipelines_batches(dtd_root):
    """The DataManager's training loader (main process and one worker process) yields the tensor
    pipeline's float batches; the test loader is tensor's."""
    tensor = DataManager(make_cfg(loader_opts(dtd_root, "tensor")))
    device = DataManager(make_cfg(loader_opts(dtd_root, "tensor_device")))
    assert isinstance(device.train_loader_x, FinishingLoader)
    assert isinstance(device.train_loader_x.dataset[(0, 5)]["img"], DeviceCrop)
    want = epoch_batches(tensor.train_loader_x)
    for a, b in zip(epoch_batches(device.train_loader_x), want, strict=True):
        assert a["img"].dtype == torch.float32 and torch.equal(a["img"], b["img"])
        assert torch.equal(a["label"], b["label"])
    a, b = next(iter(device.test_loader)), next(iter(tensor.test_loader))
    assert torch.equal(a["img"], b["img"])
    worker = DataManager(
        make_cfg(loader_opts(dtd_root, "tensor_device", "DATALOADER.NUM_WORKERS", "1"))
    )
    first = epoch_batches(worker.train_loader_x)[0]
    tensor_worker = DataManager(
        make_cfg(loader_opts(dtd_root, "tensor", "DATALOADER.NUM_WORKERS", "1"))
    )
    assert torch.equal(first["img"], epoch_batches(tensor_worker.train_loader_x)[0]["img"])


def test_other_transforms_are_refused():
    """A training transform list other than random_resized_crop (+ random_flip, normalize) gets
    one error naming the option, the transforms and the fix; tensor's own behaviour is kept."""
    from engine.data.validate import validate_data_cfg

    for transforms in ([*COOP, "colorjitter"], ["random_crop", "random_flip", "normalize"]):
        cfg = input_cfg("tensor_device", transforms=transforms)
        with pytest.raises(ValueError, match="use INPUT.PIPELINE tensor for these transforms"):
            build_transform(cfg, True, on_device=True)
        with pytest.raises(ConfigError, match="INPUT.PIPELINE tensor_device resizes"):
            validate_data_cfg(cfg)
    validate_data_cfg(input_cfg("tensor_device"))  # the default transforms qualify
    # without on_device (Dassl's float contract) and for the test transform: tensor's
    cfg = input_cfg("tensor_device")
    img = torch.randint(0, 256, (3, 40, 50), dtype=torch.uint8)
    torch.manual_seed(0)
    a = build_transform(cfg, True)(img)
    torch.manual_seed(0)
    assert torch.equal(a, build_transform(input_cfg("tensor"), True)(img))
    test = build_transform(cfg, False, on_device=True)
    assert type(device_finish_of(test)).__name__ == "DeviceFinish"


def test_train_py_trains_with_device_crops(dtd_root, tiny_clip_opts, tmp_path):
    """One short CoOp run through train.py's entry point, in this process."""
    from train import run

    out = tmp_path / "run"
    argv = ["--output-dir", str(out), "--trainer", "CoOp"]
    argv += ["--dataset-config-file", "configs/datasets/dtd.yaml"]
    argv += [*loader_opts(dtd_root, "tensor_device"), *tiny_clip_opts, "INPUT.SIZE", "(32, 32)"]
    argv += ["DATASET.NUM_SHOTS", "2", "TRAINER.COOP.PREC", "fp32", "OPTIM.MAX_EPOCH", "1"]
    assert run(argv) == 0
    log = open(osp.join(out, "log.txt")).read()
    assert "tensor_device" in log and "accuracy" in log


def test_benchmark_pixel_difference_rows(jpegs):  # noqa: F811
    """tools/benchmark.py --loader's tensor_device rows: none off from tensor on the CPU, pil's
    difference from tensor, and the float resize (a GPU's) within a few levels."""
    from experiments.benchmark_loader import pixel_difference

    same = pixel_difference(jpegs[:1], "bicubic", 2, candidate="tensor_device", reference="tensor")
    assert same["max_levels"] == 0 and same["values"] == 2 * 3 * 224 * 224
    pil = pixel_difference(jpegs[:1], "bicubic", 2, candidate="tensor_device")
    assert pil == pixel_difference(jpegs[:1], "bicubic", 2)  # tensor's difference from pil
    gpu = pixel_difference(
        jpegs[:1], "bicubic", 2, candidate="tensor_device", reference="tensor", float_resize=True
    )
    assert 0 < gpu["max_levels"] <= 4 and gpu["mean_levels"] < 0.5


def test_kept_worker_pool_serves_device_crops(dtd_root):
    """In a packed worker the kept loader workers (engine/data/worker_pool.py) collate the crops
    with the loader's collate function: the tensor pipeline's batches."""
    import engine.data.worker_pool as wp

    wp.shutdown_pool()
    try:
        want = epoch_batches(DataManager(make_cfg(loader_opts(dtd_root, "tensor"))).train_loader_x)
        wp.activate()
        opts = loader_opts(dtd_root, "tensor_device", "DATALOADER.NUM_WORKERS", "1")
        loader = DataManager(make_cfg(opts)).train_loader_x
        got = epoch_batches(loader)
        assert wp.current_pool() is not None and loader._pool_refused is None
        assert loader._pool_key in wp.current_pool().registered
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a["img"], b["img"]) and torch.equal(a["label"], b["label"])
    finally:
        wp.deactivate()
        wp.shutdown_pool()


def cached_loader(root: str, pipeline: str, *extra):
    dm = DataManager(make_cfg(loader_opts(root, pipeline, *extra)))
    dm.cache_training_images()  # what the trainer does when training starts
    assert dm.train_loader_x.dataset.images
    return dm.train_loader_x


def test_crops_of_cached_images_go_as_references(dtd_root):
    """With the decoded-image cache a worker sends no pixels for a crop (the cache's token, the
    image's index and the box); the main process cuts the crops from its own cache, and the
    batches stay tensor's bit for bit: in this process, through a worker process, and through a
    packed worker's kept pool (whose workers read the cache from shared memory)."""
    import engine.data.worker_pool as wp
    from engine.data.image_cache import cache_of

    want = epoch_batches(cached_loader(dtd_root, "tensor"))
    loader = cached_loader(dtd_root, "tensor_device")
    cache = loader.dataset.images
    item = loader.dataset[(3, 7)]
    crop = item["img"]
    assert crop.img is None and crop.source[:2] == (cache.token, 3) and cache_of(cache.token)
    top, left = crop.source[2:]
    region = cache.get(3)[:, top : top + crop.shape[1], left : left + crop.shape[2]]
    torch.manual_seed(7)  # the box is the random resized crop's draw under the item's seed
    rrc = T.RandomResizedCrop(24, scale=(0.08, 1.0))
    box = rrc.make_params([cache.get(3)])
    assert (top, left, *crop.shape[1:]) == (box["top"], box["left"], box["height"], box["width"])
    assert torch.equal(CropBatch.of([crop]).images()[0], region)
    batch = loader.collate_fn([loader.dataset[(i, i)] for i in range(4)])["img"]
    assert batch.flat.numel() == 0 and all(src is not None for src in batch.sources)
    gathered = batch.gathered()  # what the pin-memory step does for a GPU, in pinned memory
    assert all(src is None for src in gathered.sources)
    for a, b in zip(gathered.images(), batch.images(), strict=True):
        assert torch.equal(a, b) and memory_order(a) == memory_order(b) == (1, 2, 0)
    for a, b in zip(epoch_batches(loader), want, strict=True):
        assert torch.equal(a["img"], b["img"]) and torch.equal(a["label"], b["label"])
    worker = cached_loader(dtd_root, "tensor_device", "DATALOADER.NUM_WORKERS", "1")
    for a, b in zip(epoch_batches(worker), want, strict=True):
        assert torch.equal(a["img"], b["img"])
    wp.shutdown_pool()
    try:
        wp.activate()
        pooled = cached_loader(dtd_root, "tensor_device", "DATALOADER.NUM_WORKERS", "1")
        for a, b in zip(epoch_batches(pooled), want, strict=True):
            assert torch.equal(a["img"], b["img"])
        assert pooled._pool_refused is None
    finally:
        wp.deactivate()
        wp.shutdown_pool()


def test_uncached_images_and_foreign_references(dtd_root):
    """Images beyond the cache's budget go as pixels in the same batch as references; a
    reference that reaches a process without its cache is an error naming the cause."""
    loader = cached_loader(dtd_root, "tensor_device")
    cache = loader.dataset.images
    first = min(cache.tensors())
    loader.dataset.images = cache.subset([first])  # only image `first` is cached now
    items = [loader.dataset[(i, i)] for i in (first, first + 1)]
    assert items[0]["img"].source is not None and items[1]["img"].source is None
    batch = collate_crops(items)["img"]
    assert batch.flat.numel() == math.prod(items[1]["img"].shape)
    assert [src is None for src in batch.sources] == [False, True]
    assert torch.equal(batch.images()[1], items[1]["img"].img)
    token, idx, top, left = batch.sources[0]
    foreign = CropBatch(batch.flat, batch.shapes, batch.flip, [("0" * 32, idx, top, left), None])
    with pytest.raises(RuntimeError, match="does not hold"):
        foreign.images()
