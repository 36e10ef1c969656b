"""A trainer file in the style of the CoOp family (Dassl + OpenAI's ``clip``), used unchanged
through the ``dassl`` / ``clip`` compatibility layer:

    python train.py --plugin tests/examples/dassl_coop.py --trainer DasslCoOp ...

It imports from ``dassl`` and ``clip`` only, loads CLIP with the ``load_clip_to_cpu`` pattern
(``clip._MODELS`` -> ``clip._download`` -> ``torch.jit.load`` or ``torch.load`` ->
``clip.build_model``), builds CoOp's prompt learner from ``clip_model.token_embedding``, runs
the text transformer sequence-first, and trains with Dassl's ``forward_backward`` /
``model_backward_and_update`` / ``update_lr``. It reads CoOp's keys (``TRAINER.COOP``), like
KgCoOp's and ProGrad's files. tests/test_dassl_compat.py checks that its SGD run equals the
project's CoOp and that it trains with SAMPLe.
"""

import os.path as osp

import torch
import torch.nn as nn
from torch.nn import functional as F

from clip import clip
from clip.simple_tokenizer import SimpleTokenizer
from dassl.engine import TRAINER_REGISTRY, TrainerX
from dassl.metrics import compute_accuracy
from dassl.optim import build_lr_scheduler, build_optimizer
from dassl.utils import count_num_param, load_checkpoint, load_pretrained_weights

tokenizer = SimpleTokenizer()


def load_clip_to_cpu(cfg):
    url = clip._MODELS[cfg.MODEL.BACKBONE.NAME]
    path = clip._download(url)
    try:  # OpenAI's released files are TorchScript archives
        archive = torch.jit.load(path, map_location="cpu").eval()
        state_dict = None
    except RuntimeError:
        state_dict = torch.load(path, map_location="cpu")
    return clip.build_model(state_dict or archive.state_dict())


class TextEncoder(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        self.transformer = clip_model.transformer
        self.positional_embedding = clip_model.positional_embedding
        self.ln_final = clip_model.ln_final
        self.text_projection = clip_model.text_projection
        self.dtype = clip_model.dtype

    def forward(self, prompts, tokenized_prompts):
        x = prompts + self.positional_embedding.type(self.dtype)
        x = x.permute(1, 0, 2)  # [n_cls, 77, width] -> [77, n_cls, width]
        x = self.transformer(x)
        x = x.permute(1, 0, 2)  # back to [n_cls, 77, width]
        x = self.ln_final(x).type(self.dtype)
        eot = tokenized_prompts.argmax(dim=-1)  # the end token has the largest id
        return x[torch.arange(x.shape[0]), eot] @ self.text_projection


class PromptLearner(nn.Module):
    def __init__(self, cfg, classnames, clip_model):
        super().__init__()
        node = cfg.TRAINER.COOP
        dtype = clip_model.dtype
        width = clip_model.ln_final.weight.shape[0]
        if cfg.INPUT.SIZE[0] != clip_model.visual.input_resolution:
            raise ValueError("INPUT.SIZE must match the CLIP's input resolution")
        if node.CTX_INIT:
            words = node.CTX_INIT.replace("_", " ")
            n_ctx = len(words.split(" "))
            with torch.no_grad():
                embedded = clip_model.token_embedding(clip.tokenize(words)).type(dtype)
            ctx = embedded[0, 1 : 1 + n_ctx, :]
            prefix = words
        else:
            n_ctx = node.N_CTX
            ctx = torch.empty(n_ctx, width, dtype=dtype)
            nn.init.normal_(ctx, std=0.02)
            prefix = " ".join(["X"] * n_ctx)
        self.ctx = nn.Parameter(ctx)

        names = [name.replace("_", " ") for name in classnames]
        self.name_lens = [len(tokenizer.encode(name)) for name in names]
        tokenized = torch.cat([clip.tokenize(f"{prefix} {name}.") for name in names])
        with torch.no_grad():
            embedded = clip_model.token_embedding(tokenized).type(dtype)
        self.register_buffer("token_prefix", embedded[:, :1, :])  # start token
        self.register_buffer("token_suffix", embedded[:, 1 + n_ctx :, :])  # class, ".", end
        self.tokenized_prompts = tokenized
        self.n_cls, self.n_ctx = len(names), n_ctx

    def forward(self):
        ctx = self.ctx.unsqueeze(0).expand(self.n_cls, -1, -1)
        return torch.cat([self.token_prefix, ctx, self.token_suffix], dim=1)


class CustomCLIP(nn.Module):
    def __init__(self, cfg, classnames, clip_model):
        super().__init__()
        self.prompt_learner = PromptLearner(cfg, classnames, clip_model)
        self.tokenized_prompts = self.prompt_learner.tokenized_prompts
        self.image_encoder = clip_model.visual
        self.text_encoder = TextEncoder(clip_model)
        self.logit_scale = clip_model.logit_scale
        self.dtype = clip_model.dtype

    def forward(self, image):
        image_features = self.image_encoder(image.type(self.dtype))
        text_features = self.text_encoder(self.prompt_learner(), self.tokenized_prompts)
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        return self.logit_scale.exp() * image_features @ text_features.t()


@TRAINER_REGISTRY.register()
class DasslCoOp(TrainerX):
    def check_cfg(self, cfg):
        assert cfg.TRAINER.COOP.PREC in ["fp16", "fp32", "amp"]

    def build_model(self):
        cfg = self.cfg
        clip_model = load_clip_to_cpu(cfg)
        if cfg.TRAINER.COOP.PREC in ("fp32", "amp"):
            clip_model.float()  # CLIP's default precision is fp16
        self.model = CustomCLIP(cfg, self.dm.dataset.classnames, clip_model)
        for name, param in self.model.named_parameters():
            param.requires_grad_("prompt_learner" in name)
        if cfg.MODEL.INIT_WEIGHTS:
            load_pretrained_weights(self.model.prompt_learner, cfg.MODEL.INIT_WEIGHTS)
        print(f"Learnable parameters: {count_num_param(self.model.prompt_learner):,}")
        self.model.to(self.device)
        self.optim = build_optimizer(self.model.prompt_learner, cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, cfg.OPTIM)
        self.register_model("prompt_learner", self.model.prompt_learner, self.optim, self.sched)

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        output = self.model(image)
        loss = F.cross_entropy(output, label)
        self.model_backward_and_update(loss)
        summary = {"loss": loss.item(), "acc": compute_accuracy(output, label)[0].item()}
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return summary

    def parse_batch_train(self, batch):
        return batch["img"].to(self.device), batch["label"].to(self.device)

    def load_model(self, directory, epoch=None):
        model_file = "model-best.pth.tar" if epoch is None else f"model.pth.tar-{epoch}"
        for name in self.get_model_names():
            path = osp.join(directory, name, model_file)
            if not osp.exists(path):
                raise FileNotFoundError(f'Model not found at "{path}"')
            state_dict = load_checkpoint(path)["state_dict"]
            state_dict.pop("token_prefix", None)  # built for the classes of this run
            state_dict.pop("token_suffix", None)
            self._models[name].load_state_dict(state_dict, strict=False)
