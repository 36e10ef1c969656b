"""The ``dassl`` and ``clip`` compatibility layers (docs/porting-trainers.md): trainer files and
tools written against Dassl and OpenAI's ``clip`` package run unchanged.

- ``clip``: OpenAI's model interface over the project's open_clip CLIP (same outputs), its
  weight resolution (``_MODELS`` / ``_download`` / ``build_model``), tokenizer;
- ``dassl.engine.TrainerX``: Dassl's step semantics (the file steps its LR; one step per
  ``model_backward_and_update``) and the replayed second pass of sharpness-aware optimizers,
  which refuses files that change state before that call;
- end to end: a CoOp-family trainer file (tests/examples/dassl_coop.py) loaded with
  ``--plugin`` trains base-to-new with SGD (equal to the project's CoOp) and with SAMPLe (equal
  to the project's CoOp+SAMPLe), and CoOp's result parser runs on ``dassl.utils``.

Trainer files register into the process-wide registry, so the file-based cases run train.py in
subprocesses; the in-process cases use unregistered classes.
"""

from __future__ import annotations

import os
import os.path as osp
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_cfg
from helpers import coop_args
from torch import nn

from dassl.engine import ReplayError, TrainerX
from dassl.optim import build_lr_scheduler, build_optimizer
from engine.clip import TextEncoder, active_backbone, load_clip, token_ids, tokenize

EXAMPLE = osp.join(ROOT, "tests", "examples", "dassl_coop.py")


# -- clip ----------------------------------------------------------------------------------------
def _tiny_cfg(tiny_clip):
    from engine.config import get_base_cfg_default

    cfg = get_base_cfg_default()
    cfg.MODEL.BACKBONE.NAME = ""
    cfg.MODEL.BACKBONE.CONFIG, cfg.MODEL.BACKBONE.PATH = tiny_clip
    return cfg


def _load_clip_to_cpu(cfg):
    """CoOp's pattern: the name -> clip._MODELS -> clip._download -> a file -> build_model."""
    from clip import clip

    with active_backbone(cfg):
        path = clip._download(clip._MODELS[cfg.MODEL.BACKBONE.NAME])
        return clip.build_model(torch.load(path, map_location="cpu"))


def test_clip_model_has_openai_conventions_and_the_project_outputs(tiny_clip):
    from clip import clip
    from clip.simple_tokenizer import SimpleTokenizer

    cfg = _tiny_cfg(tiny_clip)
    model = _load_clip_to_cpu(cfg)
    assert model.dtype == torch.float16  # OpenAI's build_model: fp16 weights
    ref = load_clip(cfg, "fp32")
    rounded = ref.transformer.resblocks[0].mlp.c_fc.weight.half().float()
    model.float()
    model.requires_grad_(False)  # as the project's CLIP (attention takes the same kernels)
    own = model.state_dict()
    assert set(own) == set(ref.state_dict()) and "visual.class_embedding" in own
    assert all(torch.equal(own[k], v) for k, v in ref.state_dict().items())  # exact fp32
    assert not torch.equal(rounded, own["transformer.resblocks.0.mlp.c_fc.weight"])
    oc = model.open_clip_model  # the adapter's parts are the open_clip model's own (no copies)
    assert model.token_embedding is oc.token_embedding and model.logit_scale is oc.logit_scale
    visual = model.visual
    assert visual.input_resolution == 32 and visual.output_dim == 32
    assert visual.conv1 is oc.visual.conv1 and visual.proj is oc.visual.proj
    assert (model.transformer.width, model.transformer.layers) == (32, 2)
    assert len(model.transformer.resblocks) == 2

    image = torch.randn(3, 3, 32, 32)
    texts = ["a photo of a red circle.", "X X X X blue square."]
    tokens = clip.tokenize(texts)
    assert torch.equal(tokens, tokenize(texts))
    assert SimpleTokenizer().encode("green triangle") == token_ids("green triangle")
    with torch.no_grad():
        assert torch.equal(model.encode_image(image), ref.visual(image))
        expected = TextEncoder(ref).encode_tokens(tokenize(texts))
        assert torch.equal(model.encode_text(tokens), expected)
        # a trainer file's text encoder: NLD -> LND -> transformer -> NLD, block by block too
        x = model.token_embedding(tokens) + model.positional_embedding
        whole = model.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)
        y = x.permute(1, 0, 2)
        for block in model.transformer.resblocks:
            y = block(y)
        assert torch.equal(whole, y.permute(1, 0, 2))
        feats = model.ln_final(whole)[torch.arange(2), tokens.argmax(-1)] @ model.text_projection
        assert torch.equal(feats, expected)


def test_clip_model_of_a_resnet_clip(tmp_path):
    from engine.clip.toy import TINY_CLIP_CONFIG, write_tiny_clip

    vision = {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8}
    cfg = _tiny_cfg(write_tiny_clip(str(tmp_path), {**TINY_CLIP_CONFIG, "vision_cfg": vision}))
    model = _load_clip_to_cpu(cfg).float().requires_grad_(False)
    ref = load_clip(cfg, "fp32")
    assert type(model.visual).__name__ == "ModifiedResNet"
    assert (model.visual.input_resolution, model.visual.output_dim) == (32, 32)
    assert set(model.state_dict()) == set(ref.state_dict())  # OpenAI's names (attnpool, layer1)
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.encode_image(image), ref.visual(image))


def test_clip_names_resolve_through_the_project_and_fail_clearly(tiny_clip, tmp_path, monkeypatch):
    from clip import clip
    from engine.clip import BackboneError

    cfg = _tiny_cfg(tiny_clip)
    with active_backbone(cfg):  # the run's own name ("" with PATH/CONFIG) is a known model
        assert clip._download(clip._MODELS[""]) == tiny_clip[1]
    with pytest.raises(KeyError, match="MODEL.BACKBONE.PATH"):
        clip._MODELS[""]  # outside a trainer's build: only OpenAI's names
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(BackboneError, match=r"\.cache/clip/ViT-B-16\.pt"):
        clip._download(clip._MODELS["ViT-B/16"])
    from PIL import Image

    with active_backbone(_tiny_cfg(tiny_clip)):
        model, preprocess = clip.load("", device="cpu")
    assert model.dtype == torch.float32  # OpenAI's clip.load on the CPU
    assert preprocess(Image.new("RGB", (48, 40))).shape == (3, 32, 32)


# -- dassl.engine.TrainerX: Dassl's step, the replay ------------------------------------------
CLASSES = ["a", "b", "c"]


class _Linear(TrainerX):
    """A Dassl-style trainer over a linear classifier of 32x32 images (no CLIP: fast)."""

    def build_model(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, len(CLASSES)))
        self.optim = build_optimizer(self.model, self.cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, self.cfg.OPTIM)
        self.register_model("model", self.model, self.optim, self.sched)
        self.lr_steps = 0

    def update_lr(self, names=None):
        self.lr_steps += 1
        super().update_lr(names)

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        loss = F.cross_entropy(self.model(image), label)
        self.model_backward_and_update(loss)
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return {"loss": loss.item()}


class _TwoStep(_Linear):
    """The same model and loss in the engine's two-step protocol."""

    forward_backward = TrainerX.forward_backward

    def compute_loss(self, inputs):
        image, label = inputs
        return F.cross_entropy(self.model(image), label)


class _OwnOptimizerStep(_Linear):
    """CoCoOp's step: the file's own zero_grad, backward and optimizer step."""

    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        loss = F.cross_entropy(self.model(image), label)
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()
        if (self.batch_idx + 1) == self.num_batches:
            self.update_lr()
        return {"loss": loss.item()}


class _CountsBefore(_Linear):
    def forward_backward(self, batch):
        self.seen = getattr(self, "seen", 0) + 1  # a counter before the call: repeated
        return super().forward_backward(batch)


class _StepsLrFirst(_Linear):
    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        loss = F.cross_entropy(self.model(image), label)
        if (self.batch_idx + 1) == self.num_batches:
            self.sched.step()  # before the update: the replay would step it again
        self.model_backward_and_update(loss)
        return {"loss": loss.item()}


class _TwoUpdates(_Linear):
    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        self.model_backward_and_update(F.cross_entropy(self.model(image), label))
        self.model_backward_and_update(F.cross_entropy(self.model(image), label))
        return {}


class _OwnSteps(_Linear):
    def forward_backward(self, batch):
        image, label = self.parse_batch_train(batch)
        self.model_zero_grad()
        self.model_backward(F.cross_entropy(self.model(image), label))
        self.model_update()
        return {}


class _ProGradStyle(_Linear):
    """ProGrad's step: the CE gradient, its component against a guidance loss removed."""

    def losses(self, batch):
        image, label = self.parse_batch_train(batch)
        logits = self.model(image)
        return F.cross_entropy(logits, label), F.cross_entropy(logits, (label + 1) % 3)

    def forward_backward(self, batch):
        self.prograd_backward_and_update(*self.losses(batch), 0.5)
        return {}


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    return {"img": torch.randn(4, 3, 32, 32, generator=g), "label": torch.tensor([0, 1, 2, 0])}


def _trainer(cls, tiny_clip_opts, tmp_path, sam=""):
    opts = [*tiny_clip_opts, "OUTPUT_DIR", str(tmp_path), "OPTIM.NAME", "sgd", "OPTIM.LR", "0.1"]
    tr = cls(make_cfg([*opts, "OPTIM.SAM.NAME", sam]), classnames=CLASSES)
    tr.epoch, tr.batch_idx, tr.num_batches = 0, 0, 1
    tr.set_model_mode("train")
    return tr


def test_replayed_second_pass_equals_the_engine_protocol_and_steps_the_lr_once(
    tiny_clip_opts, tmp_path, batch
):
    dassl_style = _trainer(_Linear, tiny_clip_opts, tmp_path, sam="sam")
    own_step = _trainer(_OwnOptimizerStep, tiny_clip_opts, tmp_path, sam="sam")
    two_step = _trainer(_TwoStep, tiny_clip_opts, tmp_path, sam="sam")
    start = [p.detach().clone() for p in dassl_style.model.parameters()]
    summary = dassl_style.train_step(batch)
    own_step.train_step(batch)
    two_step.train_step(batch)
    for a, b, c, s in zip(
        dassl_style.model.parameters(),
        own_step.model.parameters(),
        two_step.model.parameters(),
        start,
    ):
        assert torch.equal(a, c) and torch.equal(b, c) and not torch.equal(a, s)
    for tr in (dassl_style, own_step):
        assert tr.lr_steps == 1 and tr.sched.last_epoch == 1  # once, not twice
    assert not _Linear.ENGINE_STEPS_LR and _TwoStep.ENGINE_STEPS_LR  # the two-step protocol:
    assert two_step.lr_steps == 0  # the engine steps the LR at the end of the epoch
    assert summary["loss"] == pytest.approx(
        F.cross_entropy(batch["img"].flatten(1) @ start[0].t() + start[1], batch["label"]).item()
    )  # the logged loss is the first pass's (the unperturbed weights)


@pytest.mark.parametrize(
    "cls,message",
    [
        (_CountsBefore, r"changed self\.seen before model_backward_and_update"),
        (_StepsLrFirst, r"changed the LR scheduler of 'model'"),
        (_TwoUpdates, "more than once per step"),
        (_OwnSteps, r"calls model_backward\(loss\) with the sharpness-aware optimizer 'sam'"),
        (_ProGradStyle, r"calls prograd_backward_and_update\(\) with the sharpness-aware"),
    ],
)
def test_the_replay_refuses_state_changes_and_own_steps(
    cls, message, tiny_clip_opts, tmp_path, batch
):
    with pytest.raises(ReplayError, match=message):
        _trainer(cls, tiny_clip_opts, tmp_path, sam="sam").train_step(batch)
    sgd = _trainer(cls, tiny_clip_opts, tmp_path)  # one-pass optimizers: Dassl's semantics
    before = [p.detach().clone() for p in sgd.model.parameters()]
    sgd.train_step(batch)
    assert not torch.equal(before[0], sgd.model[1].weight)


class _OwnScaler(_Linear):
    def build_model(self):
        super().build_model()
        self.scaler = torch.amp.GradScaler("cpu")  # a PREC amp branch's own scaler


def test_a_file_with_its_own_grad_scaler_is_refused_with_sharpness(tiny_clip_opts, tmp_path):
    from engine.errors import ConfigError

    tr = _trainer(_OwnScaler, tiny_clip_opts, tmp_path, sam="sam")
    assert tr.scaler is not None and tr.optim_step.scaler is None  # the file's, not the engine's
    with pytest.raises(ConfigError, match="steps its own GradScaler"):
        tr.before_train()


def test_prograd_step_removes_the_conflicting_component(tiny_clip_opts, tmp_path, batch):
    tr = _trainer(_ProGradStyle, tiny_clip_opts, tmp_path)
    params = list(tr.model.parameters())
    loss_a, loss_b = tr.losses(batch)
    g_a = torch.autograd.grad(loss_a, params, retain_graph=True)
    g_b = torch.autograd.grad(loss_b, params)
    tr.train_step(batch)
    conflicts = 0
    for p, a, b in zip(params, g_a, g_b):
        unit = b / b.norm()
        along = (a * unit).sum()
        conflicts += int(along < 0)
        expected = a - 0.5 * along * unit if along < 0 else a
        torch.testing.assert_close(p.grad, expected)
    assert conflicts > 0  # the guidance conflicts with CE for some parameter


# -- end to end: a CoOp-family file through --plugin ----------------------------------------
def _log(out: str) -> str:
    return open(osp.join(out, "log.txt")).read()


def _losses(out: str) -> list[float]:
    import json

    rows = [json.loads(line) for line in open(osp.join(out, "scalars.jsonl"))]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _ctx(out: str, epoch: int = 2) -> torch.Tensor:
    path = osp.join(out, "prompt_learner", f"model.pth.tar-{epoch}")
    return torch.load(path, weights_only=True)["state_dict"]["ctx"]


def _accuracies(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("* accuracy")]


# One subprocess runs every train.py command in turn (engine.runner.run_in_process), then loads
# a file that replaces the project's CoOp: a plugin registers for the rest of its process.
_RUNS = """
import json, sys
import datasets, trainers
from engine.runner import run_in_process
from engine.cli import build_parser, setup_cfg
from engine.registry import TRAINER_REGISTRY

runs, replacement = json.loads(sys.argv[1]), sys.argv[2]
print(json.dumps([run_in_process(argv) for argv in runs]))
cfg = setup_cfg(build_parser().parse_args(
    ["--plugin", replacement, "--trainer", "CoOp", "TRAINER.COOP.N_CTX", "4"]
))
print(TRAINER_REGISTRY.get("CoOp").__module__, cfg.TRAINER.COOP.N_CTX)
"""

_REPLACEMENT = """from dassl.engine import TRAINER_REGISTRY, TrainerX


@TRAINER_REGISTRY.register()
class CoOp(TrainerX):
    pass
"""


@pytest.mark.slow
def test_a_dassl_trainer_file_trains_base_to_new_as_the_project_coop(
    tmp_path, dtd_root, tiny_clip_opts
):
    import json

    sample = ("--optim-config-file", osp.join(ROOT, "configs/optim/CoOp/sample.yaml"))
    outs, argvs = {}, []
    for optim, optim_flags in (("sgd", ()), ("sample", sample)):
        for name, plugin in (("CoOp", ()), ("DasslCoOp", ("--plugin", EXAMPLE))):
            out, new_out = str(tmp_path / f"{name}_{optim}"), str(tmp_path / f"{name}_{optim}_new")
            base = ("OPTIM.MAX_EPOCH", "2", "DATASET.SUBSAMPLE_CLASSES", "base")
            flags = (*optim_flags, *plugin)
            argvs.append(coop_args(dtd_root, out, tiny_clip_opts, *base, trainer=name, flags=flags))
            new = ("OPTIM.MAX_EPOCH", "2", "DATASET.SUBSAMPLE_CLASSES", "new")
            flags = (*plugin, "--eval-only", "--model-dir", out, "--load-epoch", "2")
            argvs.append(
                coop_args(dtd_root, new_out, tiny_clip_opts, *new, trainer=name, flags=flags)
            )
            outs[name, optim] = (out, new_out)
    replacement = tmp_path / "coop.py"
    replacement.write_text(_REPLACEMENT)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("SAMPLE_PL_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _RUNS, json.dumps(argvs), str(replacement)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-2]) == [0] * len(argvs), proc.stderr[-3000:]
    for optim in ("sgd", "sample"):
        (coop, coop_new), (dassl, dassl_new) = outs["CoOp", optim], outs["DasslCoOp", optim]
        assert len(_losses(dassl)) == 2 * 4 and _losses(dassl) == _losses(coop)  # 4 batches
        assert torch.equal(_ctx(dassl), _ctx(coop))
        assert _accuracies(_log(dassl)) == _accuracies(_log(coop)) != []
        assert _accuracies(_log(dassl_new)) == _accuracies(_log(coop_new)) != []
    assert not torch.equal(_ctx(outs["DasslCoOp", "sgd"][0]), _ctx(outs["DasslCoOp", "sample"][0]))
    assert "Optimizer: sample(sgd)" in _log(outs["DasslCoOp", "sample"][0])
    assert "cos_g_gp" in _log(outs["DasslCoOp", "sample"][0])  # SAMPLe's diagnostics logged
    # a file registering "CoOp" replaces the project's CoOp and keeps its TRAINER.COOP keys
    assert lines[-1].split() == ["coop", "4"]
    assert "replaces this project's trainer of that name" in proc.stderr


# -- CoOp's result parser --------------------------------------------------------------------
PARSER = """
import re, sys
import os.path as osp
import numpy as np
from dassl.utils import check_isfile, listdir_nohidden

directory = sys.argv[1]
accs = []
for subdir in listdir_nohidden(directory, sort=True):
    fpath = osp.join(directory, subdir, "log.txt")
    assert check_isfile(fpath)
    found, acc = False, None
    for line in open(fpath):
        if "Finish training" in line:
            found = True
        match = re.compile(r"\\* accuracy: ([\\.\\deE+-]+)%").search(line)
        if found and match:
            acc = float(match.group(1))
    accs.append(acc)
print(f"* accuracy: {np.mean(accs):.2f}% +- {np.std(accs):.2f}%")
"""


def test_coops_result_parser_runs_on_the_dassl_layer(tmp_path, monkeypatch, capsys):
    import runpy

    for seed, acc in ((1, 60.0), (2, 70.0)):
        run = tmp_path / "out" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "log.txt").write_text(f"* accuracy: 1.0%\nFinish training\n* accuracy: {acc}%\n")
    (tmp_path / "out" / ".hidden").mkdir()  # listdir_nohidden skips it
    script = tmp_path / "parse_test_res.py"
    script.write_text(PARSER)
    import dassl

    assert osp.dirname(dassl.__file__) == osp.join(ROOT, "dassl")  # the layer, not Dassl
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "out")])
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip() == "* accuracy: 65.00% +- 5.00%"
