"""DataManager, the dataset wrapper and the loaders (Dassl's data pipeline).

Randomness: with ``SEED >= 0`` the training sampler draws its order from (seed, epoch) and every
training sample is augmented under its own seed derived from (seed, epoch, position). Results
therefore do not depend on ``DATALOADER.NUM_WORKERS`` or on whether workers persist, and a run
resumed at an epoch boundary replays exactly the epochs an uninterrupted run would have seen.
"""

from __future__ import annotations

import atexit
import logging
import weakref

import torch
from PIL import Image
from tabulate import tabulate
from torch.utils.data import Dataset, Sampler

from engine.errors import ConfigError
from engine.registry import DATASET_REGISTRY
from engine.utils import epoch_seed

from .device_crop import refer_cached
from .device_finish import device_finish_of, loader_device
from .distributed import sharded_batches
from .image_check import ImageReadError, describe, find_unreadable, handle_unreadable
from .transforms import build_transform
from .validate import validate_data_cfg
from .worker_pool import PooledFinishingLoader, PooledLoader, release_all

logger = logging.getLogger(__name__)

# Loaders with persistent workers, stopped cleanly at exit (:func:`shutdown_loaders`).
_PERSISTENT_LOADERS: weakref.WeakSet = weakref.WeakSet()


def shutdown_loader(loader) -> None:
    """Stop the worker processes of ``loader`` now (persistent ones included): each worker gets
    its stop message and is joined, the queues are closed without waiting on their feeder
    threads. The loader stays usable: its next iteration starts new workers."""
    if hasattr(loader, "release_pool"):  # a packed worker's kept workers (worker_pool)
        loader.release_pool()
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if loader is not None:
        loader._iterator = None


def shutdown_loaders() -> None:
    """Stop the workers of every loader with persistent workers that is still alive.

    Registered with ``atexit`` (after torch's own exit hook, so it runs first): at interpreter
    exit torch skips the orderly shutdown and leaves the workers to multiprocessing's exit
    handler, which terminates and joins them one by one; an orderly stop here is a message per
    worker. Also called between the runs of one process (engine/runner.py), where the
    loaders' kept worker pool (:mod:`.worker_pool`) drops the finished run's datasets.
    """
    for loader in list(_PERSISTENT_LOADERS):
        shutdown_loader(loader)
    release_all()  # the kept worker pool of a packed worker drops the runs' datasets


atexit.register(shutdown_loaders)


def read_image(path: str) -> Image.Image:
    """Open an image as RGB; a missing or corrupt file raises ImageReadError with its path."""
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except Exception as e:  # also from a loader worker: one line naming the file
        raise ImageReadError(
            f"Cannot read image {path}: {describe(e)}. It changed or became unreadable after "
            "the check at start-up; replace it, or set DATASET.SKIP_UNREADABLE True and "
            "start again"
        ) from e


def build_dataset(cfg):
    """Build the dataset named ``cfg.DATASET.NAME`` (train_x, val, test, classnames, lab2cname)."""
    if not cfg.DATASET.NAME:
        raise ConfigError(
            "DATASET.NAME is empty: pass --dataset-config-file or DATASET.NAME <name>"
        )
    logger.info("Loading dataset: %s", cfg.DATASET.NAME)
    return DATASET_REGISTRY.get(cfg.DATASET.NAME)(cfg)


class EpochSampler(Sampler):
    """Yields ``(index, sample_seed)`` pairs: a seeded order per epoch, a seed per sample.

    Args:
        num_items: dataset length.
        shuffle: random order (RandomSampler) or sequential.
        seed: run seed; negative means unseeded (fresh randomness, samples get no seed).
    """

    def __init__(self, num_items: int, shuffle: bool = True, seed: int = -1):
        self.num_items = num_items
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self):
        if self.seed >= 0:
            g = torch.Generator()
            g.manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_items, generator=g) if self.shuffle else None
            seeds = torch.randint(0, 2**62, (self.num_items,), generator=g).tolist()
        else:
            order = torch.randperm(self.num_items) if self.shuffle else None
            seeds = [None] * self.num_items
        indices = order.tolist() if order is not None else range(self.num_items)
        for pos, idx in enumerate(indices):
            yield (idx, seeds[pos])


class DatasetWrapper(Dataset):
    """Turns Datum lists into training/test samples (Dassl's item dict).

    Each item is ``{"img", "label", "domain", "impath", "index"}``; with ``K_TRANSFORMS > 1``
    "img" is a list of augmented views, and ``RETURN_IMG0`` adds the un-augmented "img0".
    Indices may come as ``(index, seed)`` from :class:`EpochSampler`; the transforms then run
    under that seed (without disturbing the caller's random state).
    """

    def __init__(self, cfg, data_source, transform=None, is_train: bool = False, images=None):
        self.cfg = cfg
        self.data_source = data_source
        self.transform = transform
        self.is_train = is_train
        self.k_tfm = cfg.DATALOADER.K_TRANSFORMS if is_train else 1
        self.return_img0 = cfg.DATALOADER.RETURN_IMG0
        if self.k_tfm > 1 and transform is None:
            raise ValueError("Cannot augment images K_TRANSFORMS times without a transform")
        self.images = images  # optional in-memory store of decoded images (see image_cache)
        self.to_tensor = build_transform(cfg, is_train=False, choices=["normalize"])

    def __len__(self) -> int:
        return len(self.data_source)

    def load(self, idx: int):
        if self.images is not None:
            img = self.images.get(idx)
            if img is not None:
                return img
        return read_image(self.data_source[idx].impath)

    def __getitem__(self, key):
        idx, seed = key if isinstance(key, tuple) else (key, None)
        item = self.data_source[idx]
        output = {"label": item.label, "domain": item.domain, "impath": item.impath, "index": idx}
        img0 = self.load(idx)
        if seed is None:
            self._fill(output, img0)
        else:
            with torch.random.fork_rng(devices=[]):
                # the CPU generator only: the transforms draw from it, and torch.manual_seed
                # would also reseed (and, before CUDA is initialised, queue a stack trace for)
                # every GPU generator per sample
                torch.random.default_generator.manual_seed(seed)
                self._fill(output, img0)
        if self.images is not None and isinstance(img0, torch.Tensor):
            # INPUT.PIPELINE tensor_device: the crops of a cached image go as references
            refer_cached(output, img0, self.images, idx)
        if self.return_img0:
            output["img0"] = self.to_tensor(img0)
        return output

    def _fill(self, output: dict, img0) -> None:
        if self.transform is None:
            output["img"] = img0
            return
        tfms = self.transform if isinstance(self.transform, (list, tuple)) else [self.transform]
        for i, tfm in enumerate(tfms):
            views = [tfm(img0) for _ in range(self.k_tfm)]
            output["img" if i == 0 else f"img{i + 1}"] = views[0] if len(views) == 1 else views


def build_data_loader(
    cfg,
    data_source,
    batch_size: int,
    tfm,
    is_train: bool,
    sampler_type: str = "SequentialSampler",
    dataset_wrapper=None,
    images=None,
):
    """A DataLoader over ``data_source`` with Dassl's settings.

    Training loaders keep every sample unless ``DATALOADER.TRAIN_X.DROP_LAST`` (Dassl's
    behaviour, set by the paper grid's protocols): then the last partial batch is dropped when
    the set is at least one batch (1-shot OxfordPets: 37 samples, batch 32: 5 dropped).
    """
    if sampler_type not in ("RandomSampler", "SequentialSampler"):
        raise ValueError(
            f"Unknown sampler '{sampler_type}'; available: RandomSampler, SequentialSampler"
        )
    wrapper = (dataset_wrapper or DatasetWrapper)(cfg, data_source, tfm, is_train, images=images)
    seed = cfg.SEED if is_train else -1
    sampler = EpochSampler(len(data_source), shuffle=sampler_type == "RandomSampler", seed=seed)
    num_workers = cfg.DATALOADER.NUM_WORKERS
    drop_last = is_train and cfg.DATALOADER.TRAIN_X.DROP_LAST and len(data_source) >= batch_size
    shards = sharded_batches(sampler, batch_size, drop_last, is_train)  # data-parallel (#29)
    finish = device_finish_of(tfm)  # INPUT.PIPELINE tensor: uint8 batches finished on the device
    extra = {"finish": finish, "device": loader_device(cfg)} if finish is not None else {}
    if getattr(finish, "collate", None) is not None:  # INPUT.PIPELINE tensor_device's crops
        extra["collate_fn"] = finish.collate
    # a DataLoader, served by a packed worker's kept worker pool there (worker_pool)
    loader = (PooledFinishingLoader if finish is not None else PooledLoader)(
        wrapper,
        batch_size=batch_size if shards is None else 1,
        sampler=sampler if shards is None else None,
        batch_sampler=shards,
        num_workers=num_workers,
        drop_last=drop_last if shards is None else False,
        pin_memory=torch.cuda.is_available() and cfg.USE_CUDA,
        persistent_workers=num_workers > 0 and is_train,
        **extra,
    )
    if loader.persistent_workers:
        _PERSISTENT_LOADERS.add(loader)
    return loader


class DataManager:
    """Builds the dataset and its loaders: ``train_loader_x``, ``val_loader``, ``test_loader``.

    Args:
        cfg: the config.
        custom_tfm_train, custom_tfm_test: transforms replacing the ones built from the config.
        dataset_wrapper: a DatasetWrapper subclass.
        dataset: an already built dataset (skips ``build_dataset``).
    """

    def __init__(
        self,
        cfg,
        custom_tfm_train=None,
        custom_tfm_test=None,
        dataset_wrapper=None,
        dataset=None,
    ):
        validate_data_cfg(cfg)
        self.cfg = cfg
        dataset = dataset if dataset is not None else build_dataset(cfg)
        if not dataset.train_x and not dataset.test:
            raise ValueError(f"Dataset {cfg.DATASET.NAME} has no images")
        self.check_eval_images(dataset)
        self._train_images_checked = False
        tfm_train = custom_tfm_train or build_transform(cfg, is_train=True, on_device=True)
        tfm_test = custom_tfm_test or build_transform(cfg, is_train=False, on_device=True)
        self.tfm_train, self.tfm_test = tfm_train, tfm_test

        self.train_loader_x = None
        if dataset.train_x:
            self.train_loader_x = build_data_loader(
                cfg,
                dataset.train_x,
                cfg.DATALOADER.TRAIN_X.BATCH_SIZE,
                tfm_train,
                is_train=True,
                sampler_type=cfg.DATALOADER.TRAIN_X.SAMPLER,
                dataset_wrapper=dataset_wrapper,
            )

        def eval_loader(data_source):
            return build_data_loader(
                cfg,
                data_source,
                cfg.DATALOADER.TEST.BATCH_SIZE,
                tfm_test,
                is_train=False,
                sampler_type=cfg.DATALOADER.TEST.SAMPLER,
                dataset_wrapper=dataset_wrapper,
            )

        self.val_loader = eval_loader(dataset.val) if dataset.val else None
        self.test_loader = eval_loader(dataset.test)
        self._num_classes = dataset.num_classes
        self._num_source_domains = max(len(cfg.DATASET.SOURCE_DOMAINS), 1)
        self._lab2cname = dataset.lab2cname
        self.dataset = dataset
        if cfg.VERBOSE:
            self.show_dataset_summary()

    def close(self) -> None:
        """Stop the loaders' worker processes (the persistent training workers included)."""
        for loader in (self.train_loader_x, self.val_loader, self.test_loader):
            shutdown_loader(loader)

    @property
    def num_classes(self) -> int:
        return self._num_classes

    @property
    def num_source_domains(self) -> int:
        return self._num_source_domains

    @property
    def lab2cname(self) -> dict[int, str]:
        return self._lab2cname

    def check_eval_images(self, dataset) -> None:
        """Check the val and test images (fast, see :mod:`.image_check`) before anything runs:
        unreadable ones raise, listed together, or are dropped (DATASET.SKIP_UNREADABLE)."""
        checked = {}  # ImageNet's val is its test list: checked once
        for name in ("test", "val"):
            items = getattr(dataset, name)
            if items:
                if id(items) not in checked:
                    checked[id(items)] = find_unreadable(items)
                bad = checked[id(items)]
                dataset.drop_images(handle_unreadable(self.cfg, bad, name, len(items)), [name])

    def cache_training_images(self) -> None:
        """Check every training image and decode them once into memory
        (``DATALOADER.CACHE_DECODED``).

        Called by the trainer when training starts (not for evaluation-only runs), before the
        loader's workers exist, so they share the decoded images. Unreadable images raise one
        error listing all of them, or are dropped with ``DATASET.SKIP_UNREADABLE True`` (the
        loader then has fewer samples).
        """
        loader = self.train_loader_x
        if loader is None or self._train_images_checked:
            return
        from .image_cache import DecodedImageCache
        from .worker_pool import prepare_pool

        prepare_pool(loader)  # a packed worker forks its kept workers before the images exist
        wrapper = loader.dataset
        items = wrapper.data_source
        if self.cfg.DATALOADER.CACHE_DECODED and not wrapper.images:
            cache, bad = DecodedImageCache.build_checked(self.cfg, items)
        else:
            cache, bad = wrapper.images, find_unreadable(items)
        dropped = handle_unreadable(self.cfg, bad, "training", len(items))
        if dropped:
            keep = [i for i, d in enumerate(items) if d.impath not in dropped]
            wrapper.data_source = [items[i] for i in keep]
            getattr(loader.batch_sampler, "sampler", loader.sampler).num_items = len(keep)
            cache = cache.subset(keep) if cache is not None else None
            self.dataset.drop_images(dropped, ["train_x"])
        wrapper.images = cache
        self._train_images_checked = True

    def show_dataset_summary(self) -> None:
        dataset = self.dataset
        table = [["Dataset", self.cfg.DATASET.NAME]]
        if self.cfg.DATASET.SUBSAMPLE_CLASSES != "all":
            table.append(["Classes", self.cfg.DATASET.SUBSAMPLE_CLASSES])
        table.append(["# classes", f"{self.num_classes:,}"])
        table.append(["# train_x", f"{len(dataset.train_x or []):,}"])
        if dataset.val:
            table.append(["# val", f"{len(dataset.val):,}"])
        table.append(["# test", f"{len(dataset.test or []):,}"])
        logger.info(tabulate(table))
