"""Three trainers of one model and loss, one per way of driving the optimizer step (loaded with
``--plugin``; tests/test_step_doors.py runs every registered optimizer through each):

- ``DoorsEngine``: the engine's two-step protocol (``compute_loss``; engine.trainer.TrainerX);
- ``DoorsDassl``: a Dassl file's ``forward_backward`` with ``model_backward_and_update(loss)``
  (CoOp's step);
- ``DoorsDasslOwnStep``: a Dassl file's own ``zero_grad(); loss.backward(); optim.step()``
  (CoCoOp's step).

The model is a float64 linear classifier of the mean-pooled image (no CLIP: fast and exact), so
the three give the same parameters up to float64 rounding.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dassl.engine import TRAINER_REGISTRY, TrainerX
from dassl.optim import build_lr_scheduler, build_optimizer
from engine.registry import TRAINER_REGISTRY as ENGINE_TRAINERS
from engine.trainer import TrainerX as EngineTrainerX


class Linear(nn.Module):
    def __init__(self, n_cls: int):
        super().__init__()
        self.fc = nn.Linear(3 * 4 * 4, n_cls).double()

    def forward(self, image):
        pooled = F.adaptive_avg_pool2d(image.double(), 4)  # [batch, 3, 4, 4]
        return self.fc(pooled.flatten(1))  # [batch, n_cls]


class _Doors:
    def build_model(self):
        torch.manual_seed(max(self.cfg.SEED, 0))
        self.model = Linear(self.num_classes).to(self.device)
        self.optim = build_optimizer(self.model, self.cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, self.cfg.OPTIM)
        self.register_model("model", self.model, self.optim, self.sched)

    def parse_batch_train(self, batch):
        return batch["img"].to(self.device), batch["label"].to(self.device)

    def model_inference(self, image):
        return self.model(image)


@ENGINE_TRAINERS.register()
class DoorsEngine(_Doors, EngineTrainerX):
    def compute_loss(self, inputs):
        image, label = inputs
        return self.classification_loss(self.model(image), label)


@TRAINER_REGISTRY.register()
class DoorsDassl(_Doors, TrainerX):
    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        loss = F.cross_entropy(self.model(image), label)
        self.model_backward_and_update(loss)
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return {"loss": loss.item()}


@TRAINER_REGISTRY.register()
class DoorsDasslOwnStep(_Doors, TrainerX):
    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        loss = F.cross_entropy(self.model(image), label)
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return {"loss": loss.item()}
