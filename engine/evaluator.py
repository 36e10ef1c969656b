"""Evaluators. ``Classification`` prints Dassl's result block, which result parsers read::

=> result
* total: 1,234
* correct: 1,000
* accuracy: 81.0%
* error: 19.0%
* macro_f1: 80.5%
"""

from __future__ import annotations

import logging
import os.path as osp
from collections import OrderedDict

import torch

from .registry import EVALUATOR_REGISTRY
from .utils import atomic_torch_save

logger = logging.getLogger(__name__)


def build_evaluator(cfg, **kwargs):
    """Build the evaluator named ``cfg.TEST.EVALUATOR``."""
    return EVALUATOR_REGISTRY.get(cfg.TEST.EVALUATOR)(cfg, **kwargs)


class EvaluatorBase:
    def __init__(self, cfg):
        self.cfg = cfg

    def reset(self):
        raise NotImplementedError

    def process(self, mo, gt):
        raise NotImplementedError

    def evaluate(self):
        raise NotImplementedError


@EVALUATOR_REGISTRY.register()
class Classification(EvaluatorBase):
    """Accuracy, error and macro-F1 over all processed batches.

    Predictions are accumulated on the device and read once in :meth:`evaluate`.
    """

    def __init__(self, cfg, lab2cname=None, **kwargs):
        super().__init__(cfg)
        self._lab2cname = lab2cname
        self.reset()

    def reset(self):
        self._preds: list[torch.Tensor] = []
        self._gts: list[torch.Tensor] = []

    def process(self, mo: torch.Tensor, gt: torch.Tensor):
        """Add a batch: ``mo`` logits [batch, num_classes], ``gt`` labels [batch]."""
        self._preds.append(mo.argmax(dim=1).detach())
        self._gts.append(gt.detach().to(mo.device))

    def evaluate(self) -> OrderedDict:
        if not self._preds:
            raise RuntimeError("Evaluator.evaluate() called before any batch was processed")
        pred = torch.cat(self._preds).cpu()
        gt = torch.cat(self._gts).cpu()
        total = gt.numel()
        correct = int((pred == gt).sum())
        acc = 100.0 * correct / total
        err = 100.0 - acc
        num_classes = int(max(pred.max(), gt.max())) + 1
        cmat = torch.zeros(num_classes, num_classes, dtype=torch.long)
        cmat.index_put_((gt, pred), torch.ones_like(gt), accumulate=True)
        tp = cmat.diag().double()
        precision = tp / cmat.sum(0).double().clamp_min(1)
        recall = tp / cmat.sum(1).double().clamp_min(1)
        f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        present = cmat.sum(1) + cmat.sum(0) > 0  # classes seen as label or prediction
        macro_f1 = 100.0 * float(f1[present].mean())
        results = OrderedDict(accuracy=acc, error=err, macro_f1=macro_f1)
        logger.info(
            "=> result\n"
            f"* total: {total:,}\n"
            f"* correct: {correct:,}\n"
            f"* accuracy: {acc:.1f}%\n"
            f"* error: {err:.1f}%\n"
            f"* macro_f1: {macro_f1:.1f}%"
        )
        if self.cfg.TEST.PER_CLASS_RESULT:
            lines = ["=> per-class result"]
            accs = []
            for label in gt.unique().tolist():
                n = int(cmat[label].sum())
                c = int(cmat[label, label])
                a = 100.0 * c / max(n, 1)
                accs.append(a)
                name = self._lab2cname.get(label, str(label)) if self._lab2cname else str(label)
                lines.append(
                    f"* class: {label} ({name})\ttotal: {n:,}\tcorrect: {c:,}\tacc: {a:.1f}%"
                )
            mean_acc = sum(accs) / len(accs)
            lines.append(f"* average: {mean_acc:.1f}%")
            results["perclass_accuracy"] = mean_acc
            logger.info("\n".join(lines))
        if self.cfg.TEST.COMPUTE_CMAT:
            norm = cmat.double() / cmat.sum(1, keepdim=True).clamp_min(1)
            path = osp.join(self.cfg.OUTPUT_DIR, "cmat.pt")
            atomic_torch_save(norm, path)
            logger.info("Confusion matrix is saved to %s", path)
        return results
