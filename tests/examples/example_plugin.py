"""A worked extension example: a new sharpness-aware optimizer and a new trainer, each the code
of one file, registered when this module is imported (``pytest -p example_plugin``).

- ``shrinksam``: SAM whose radius is scaled by a new hyper-parameter ``OPTIM.SAM.SHRINK``
  (declared here with :class:`optim.HParam`; the config gains the key from the registry).
- ``LabelSmoothCoOp``: CoOp with a label-smoothed cross-entropy and its own config node
  ``TRAINER.LABELSMOOTHCOOP`` (the keys of CoOp plus ``SMOOTHING``).

``tests/test_extension_example.py`` runs the shared suites with this plugin loaded and checks
that they pick both up without any edit to the suites.
"""

from __future__ import annotations

import torch

from engine.registry import TRAINER_REGISTRY
from engine.utils import compute_accuracy
from optim import HParam, register_optimizer
from optim.sharpness import EPS, SharpnessAwareOptimizer
from trainers.coop import CoOp, add_coop_config

# declared once: the config key, its default and help, its range (config check and constructor)
SHRINK = HParam(
    "SHRINK", "shrink", 0.5, "shrinksam: radius factor", lambda v: 0 < v <= 1, "a number in (0, 1]"
)


class ShrinkSAM(SharpnessAwareOptimizer):
    """SAM with the radius ``shrink * rho``: ``e = shrink * rho * g / (||g|| + eps)``."""

    def __init__(
        self,
        params,
        base_optimizer=torch.optim.SGD,
        rho: float = 0.05,
        shrink: float = SHRINK.default,
        variant: str = "paper",
        schedule: str = "constant",
        **base_kwargs,
    ):
        SHRINK.check(shrink)
        defaults = dict(rho=rho, shrink=shrink)
        super().__init__(params, base_optimizer, defaults, variant, schedule, **base_kwargs)

    def _perturbation(self, fp, g, g_norm, scale):
        denom = g_norm + EPS
        return [gi * (gr["shrink"] * gr["rho"] * scale / denom) for gr, gi in zip(fp.groups, g)]


register_optimizer(
    "shrinksam",
    ShrinkSAM,
    "SAM with a shrunk radius (extension example)",
    kind="sharpness",
    needs_closure=True,
    hparams=("RHO", SHRINK, "VARIANT", "SCHEDULE"),
    test_kwargs=dict(rho=0.05, shrink=0.5),
)


def add_label_smooth_config(cfg) -> None:
    add_coop_config(cfg)  # CoOp's keys (under TRAINER.COOP) ...
    node = cfg.TRAINER.COOP.clone()
    node.SMOOTHING = 0.1  # ... copied into this trainer's own node, plus its new key
    cfg.TRAINER.LABELSMOOTHCOOP = node


@TRAINER_REGISTRY.register()
class LabelSmoothCoOp(CoOp):
    """CoOp with label smoothing (extension example)."""

    CONFIG_NODE = "LABELSMOOTHCOOP"
    add_config = staticmethod(add_label_smooth_config)

    def check_cfg(self, cfg):
        pass

    def build_model(self):
        from engine.clip import load_clip
        from trainers.common import setup_prompt_learner
        from trainers.coop import CustomCLIP

        clip_model = load_clip(self.cfg, precision=self.prec, device=self.device)
        cfg = self.cfg.clone()
        cfg.defrost()
        cfg.TRAINER.COOP = self.trainer_cfg()  # CoOp's model reads its keys from this node
        self.model = CustomCLIP.from_config(cfg, self.classnames, clip_model).to(self.device)
        setup_prompt_learner(self)

    def compute_loss(self, inputs):
        image_features, label = inputs
        logits = self.model.logits(image_features, self.model.encode_text())
        smoothing = self.trainer_cfg().SMOOTHING
        # through classification_loss: the optimizers that read the pass's logits (ESAM, SAF,
        # MESA) get them, with the same smoothing in their per-item losses
        loss = self.classification_loss(logits, label, label_smoothing=smoothing)
        return loss, {"acc": compute_accuracy(logits, label)[0]}
