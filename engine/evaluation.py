"""Evaluation of a trainer: the test loop and the on-disk cache of frozen image features.

A trainer whose evaluation logits depend on the images only through a frozen image encoder
(zero-shot CLIP, CoOp, CoCoOp, TCP) returns that encoder from :meth:`frozen_image_encoder` and
implements :meth:`model_inference_features`; each evaluation set is then encoded once and the
features are reused from ``TEST.FEATURE_CACHE_DIR`` by every later run with the same weights,
precision, images and transform. Other trainers (prompted image encoders) run
:meth:`model_inference` batch by batch.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm import tqdm

from . import distributed
from .faults import fault_point
from .feature_cache import (
    FeatureCache,
    cache_key,
    compute_features,
    data_fingerprint,
    module_fingerprint,
)

logger = logging.getLogger(__name__)


class EvaluationMixin:
    """``test(split)`` and its hooks. Needs the trainer's ``cfg``, ``evaluator``, loaders,
    ``autocast()``, ``set_model_mode`` and ``write_scalar``."""

    def before_test(self) -> None:
        """Called once before an evaluation loop (e.g. to compute class text features)."""

    def after_test(self) -> None:
        """Called once after an evaluation loop (e.g. to drop cached features)."""

    def frozen_image_encoder(self) -> nn.Module | None:
        """The frozen image encoder whose raw output alone feeds the evaluation logits, or None.

        Trainers that return it (zero-shot CLIP, CoOp, CoCoOp, TCP) implement
        :meth:`model_inference_features`; the engine then encodes each evaluation set once and
        reuses the features from the on-disk cache (``TEST.FEATURE_CACHE``).
        """
        return None

    def model_inference_features(self, features: torch.Tensor) -> torch.Tensor:
        """Logits from raw frozen image features ``[batch, dim]`` (see frozen_image_encoder)."""
        raise NotImplementedError

    @torch.no_grad()
    def test(self, split: str | None = None) -> float:
        """Evaluate on ``split`` (default TEST.SPLIT) and return the first metric (accuracy)."""
        self.set_model_mode("eval")
        self.evaluator.reset()
        split = split or self.cfg.TEST.SPLIT
        if split == "val" and self.val_loader is not None:
            loader = self.val_loader
        else:
            split, loader = "test", self.test_loader
        logger.info("Evaluate on the *%s* set", split)
        encoder = self.frozen_image_encoder()
        nonfinite = []  # per batch: number of images with a non-finite logit (0-d tensors)
        with self.compiled_batch(1, 1, training=False):
            self.before_test()
        try:
            if encoder is not None:
                features, labels = self._eval_features(encoder, loader, split)
                step = loader.batch_size or self.cfg.DATALOADER.TEST.BATCH_SIZE or 100
                for i in range(0, len(labels), step):
                    chunk = features[i : i + step]
                    with self.compiled_batch(len(chunk), step, training=False), self.autocast():
                        output = self.model_inference_features(chunk)
                    nonfinite.append((~torch.isfinite(output).all(dim=-1)).sum())
                    self.evaluator.process(output.float(), labels[i : i + step])
            else:
                shard = [] if distributed.data_parallel() else None  # data-parallel (#29)
                for batch in tqdm(loader, desc=f"eval {split}", leave=False, disable=None):
                    input, label = self.parse_batch_test(batch)
                    full = loader.batch_size or self.cfg.DATALOADER.TEST.BATCH_SIZE or len(label)
                    with self.compiled_batch(len(label), full, training=False), self.autocast():
                        output = self.model_inference(input)
                    if shard is not None:  # gathered below, in the set's order
                        shard.append((output.float(), label))
                        continue
                    nonfinite.append((~torch.isfinite(output).all(dim=-1)).sum())
                    self.evaluator.process(output.float(), label)
                if shard is not None:
                    output = distributed.gather_rows(torch.cat([o for o, _ in shard]))
                    label = distributed.gather_rows(torch.cat([lab for _, lab in shard]))
                    nonfinite.append((~torch.isfinite(output).all(dim=-1)).sum())
                    self.evaluator.process(output, label)
        finally:
            self.after_test()
        self._check_finite_logits(nonfinite, split)
        fault_point("evaluate")  # tests kill here (engine/faults.py)
        results = self.evaluator.evaluate()
        for k, v in results.items():
            self.write_scalar(f"{split}/{k}", v, self.epoch)
        self.flush_scalars()
        return list(results.values())[0]

    def _check_finite_logits(self, nonfinite: list, split: str) -> None:
        """Refuse to report an accuracy computed from NaN/inf logits (one host sync)."""
        if not nonfinite:
            return
        bad = int(torch.stack(nonfinite).sum())
        if bad:
            raise FloatingPointError(
                f"Evaluation on the {split} set gave non-finite (NaN/inf) logits for {bad} "
                "image(s), so no accuracy is reported: the model's weights are not finite (a "
                "diverged run or a damaged checkpoint) or the precision overflows (try "
                "PREC fp32). Evaluate a checkpoint from before the divergence (--load-epoch)."
            )

    def _eval_features(self, encoder: nn.Module, loader, split: str):
        """Raw features of the evaluation images: from the disk cache or computed (and cached)."""
        cfg = self.cfg
        dtype = compute_dtype(encoder)

        full = loader.batch_size

        def encode(images):
            with self.compiled_batch(len(images), full or len(images), training=False):
                return encoder(images.to(dtype))

        cache = FeatureCache(cfg.TEST.FEATURE_CACHE_DIR) if cfg.TEST.FEATURE_CACHE else None
        key = None
        if cache is not None:
            key = cache_key(
                weights=module_fingerprint(encoder),
                precision=self.prec,
                device=self.device.type,
                dataset=cfg.DATASET.NAME,
                split=split,
                data=data_fingerprint(loader.dataset.data_source),
                transform=repr(loader.dataset.transform),
            )
            hit = cache.load(key) if distributed.is_main_process() else None
            if distributed.main_decides(hit is not None) and distributed.data_parallel():
                # data-parallel (#29): rank 0 read the cache; every process gets its features
                # (no process but rank 0 reads or writes the cache: node-local caches agree)
                sent = [hit["features"], hit["labels"]] if hit is not None else None
                features, labels = distributed.broadcast_tensors(sent)
                hit = {"features": features, "labels": labels}
            if hit is not None:
                logger.info("Evaluation features loaded from %s", cache.path(key))
                return hit["features"].to(self.device), hit["labels"].to(self.device)
        wrapped = tqdm(loader, desc=f"encode {split}", leave=False, disable=None)
        features, labels = compute_features(encode, wrapped, self.device, self.autocast)
        # data-parallel (#29): every process encoded its shard; all of them, in the set's order
        features, labels = distributed.gather_rows(features), distributed.gather_rows(labels)
        if cache is not None and distributed.is_main_process():  # #29: one writer
            cache.save(key, features, labels)
            logger.info("Evaluation features saved to %s", cache.path(key))
        return features, labels.to(self.device)

    def model_inference(self, input):
        return self.model(input)

    def parse_batch_test(self, batch):
        dev = self.device
        return batch["img"].to(dev, non_blocking=True), batch["label"].to(dev, non_blocking=True)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: that of its first conv/linear weight (fp16 CLIP keeps
    embeddings and norms in fp32)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            return m.weight.dtype
    return next(module.parameters()).dtype
