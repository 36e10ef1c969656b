"""Helpers shared by several test modules (tests import from here, never from each other).

The 4-block tiny CLIP of the deep-prompt trainers (MaPLe, CoPrompt, ...), in-process trainer
builders, step/staging checks and the train.py base-to-new round trip.
"""

from __future__ import annotations

import json
import os.path as osp
import re

import pytest
import torch
from conftest import ROOT, make_cfg

from datasets.synthetic import DTD_CLASSES
from engine import build_trainer
from engine.clip.toy import TINY_OPTS, write_tiny_clip
from engine.registry import TRAINER_REGISTRY

DEEP_CLIP = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 4, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 4},
}
N_CTX, DEPTH = 2, 3
MAPLE_CFG = "configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml"
PROJECTIONS = {"proj.weight", "proj.bias"} | {
    f"compound_prompt_projections.{i}.{k}" for i in range(DEPTH - 1) for k in ("weight", "bias")
}
SAMPLE_FILE = "configs/optim/MaPLe/sample.yaml"
PROMPTS = {"ctx"} | {f"compound_prompts_text.{i}" for i in range(DEPTH - 1)}


def write_deep_clip(folder: str) -> list[str]:
    """Write the 4-block tiny CLIP to ``folder``; the options that select it (plus TINY_OPTS)."""
    cfg_path, ckpt = write_tiny_clip(folder, config=DEEP_CLIP)
    backbone = ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    return [*backbone, "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]


def trainer_opts(root, out, deep_opts, trainer="MaPLe", prec="fp32", *extra):
    key = f"TRAINER.{trainer.upper()}"
    return [
        "--root", root, "--seed", "1", "--output-dir", out, *deep_opts,
        f"{key}.PREC", prec, f"{key}.PROMPT_DEPTH", str(DEPTH), f"{key}.N_CTX", str(N_CTX),
        "OPTIM.NAME", "sgd", "OPTIM.LR", "0.01", "OPTIM.MAX_EPOCH", "1",
        "DATASET.NUM_SHOTS", "2", "TEST.NO_TEST", "True", *extra,
    ]  # fmt: skip


def build(tmp_path, root, deep_opts, *extra, trainer="MaPLe", prec="fp32", optim_file=""):
    """An in-process trainer; ``optim_file``: a file under configs/optim/<trainer>/."""
    flags = ["--optim-config-file", osp.join(ROOT, optim_file)] if optim_file else []
    opts = trainer_opts(root, str(tmp_path / f"out_{prec}"), deep_opts, trainer, prec, *extra)
    return build_trainer(make_cfg(flags + opts, trainer=trainer))


def steps_until_update(tr, param: str = "ctx") -> dict:
    """Training steps (as the engine runs them) until ``learnable.<param>`` changes: amp's
    first steps may be skipped while the GradScaler backs off from an overflow."""
    tr.set_model_mode("train")
    before = dict(tr.model.learnable.named_parameters())[param].detach().clone()
    for i, batch in enumerate(tr.train_loader_x):
        tr.batch_idx = i
        out = tr.forward_backward(batch)
        if not torch.equal(before, dict(tr.model.learnable.named_parameters())[param]):
            return out
    raise AssertionError(f"{param} never changed in {len(tr.train_loader_x)} steps")


def assert_one_step_updates(tr, max_tries: int = 4) -> dict:
    """One training step changes every learnable tensor (fp32, finite). Under amp the first
    steps may be skipped while the GradScaler backs off from 65536 (as on a GPU). Returns the
    step's output dict."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    batch = next(iter(tr.train_loader_x))
    tr.batch_idx = 0
    for _ in range(max_tries if tr.prec == "amp" else 1):
        out = tr.forward_backward(batch)
        assert torch.isfinite(out["loss"])
        if not torch.equal(before[0], params[0]):
            break
    for b, p in zip(before, params, strict=True):
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
        assert not torch.equal(b, p)
    return out


def staged_run(tr) -> dict:
    """Train with snapshots of the learnable state at the start of every epoch."""
    snaps = {}
    before = tr.before_epoch

    def before_epoch():
        before()
        snaps[tr.epoch] = {
            k: v.detach().clone() for k, v in tr.model.learnable.state_dict().items()
        }

    tr.before_epoch = before_epoch
    tr.train()
    snaps["end"] = {k: v.detach().clone() for k, v in tr.model.learnable.state_dict().items()}
    return snaps


def check_staged(tr, snaps, frozen: set, trained: set) -> None:
    """``frozen`` trained in stage 1 and frozen from the sharpness-aware stage on (stage 2 after
    ``OPTIM.MAX_EPOCH``, or ``START_EPOCH``); ``trained`` trained in that stage."""
    start = tr.optim_step.staging.start_epoch
    params = dict(tr.model.learnable.named_parameters())
    assert {n for n, p in params.items() if not p.requires_grad} == frozen
    for name in frozen:
        assert not torch.equal(snaps[0][name], snaps[start][name]), name  # trained in stage 1
        assert torch.equal(snaps[start][name], snaps["end"][name]), name  # frozen in stage 2
    for name in trained:
        assert not torch.equal(snaps[start][name], snaps["end"][name]), name


def train_py_args(root, out, deep_opts, trainer, config_files, *extra):
    key = f"TRAINER.{trainer.upper()}"
    config_files = [config_files] if isinstance(config_files, str) else config_files
    return [
        "--root", root, "--seed", "1", "--trainer", trainer,
        "--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml"),
        "--config-file", *[osp.join(ROOT, f) for f in config_files], "--output-dir", out,
        *deep_opts,
        f"{key}.PREC", "fp32", f"{key}.PROMPT_DEPTH", str(DEPTH), f"{key}.N_CTX", str(N_CTX),
        "DATASET.NUM_SHOTS", "2", *extra,
    ]  # fmt: skip


def accuracy(log: str) -> float:
    return float(re.findall(r"\* accuracy: ([\d.]+)%", log)[-1])


def check_base_to_new(tmp_path, dtd_root, deep_opts, trainer, config_files, names, *extra):
    """SGD and staged SAMPLe runs on the base classes, then the new classes from the SAMPLe
    checkpoint."""
    sgd_out, sam_out = str(tmp_path / "sgd"), str(tmp_path / "sample")
    base = ("DATASET.SUBSAMPLE_CLASSES", "base", *extra)
    train_in_process(train_py_args(dtd_root, sgd_out, deep_opts, trainer, config_files, *base,
                                   "OPTIM.MAX_EPOCH", "1"))  # fmt: skip
    log = open(osp.join(sgd_out, "log.txt")).read()
    assert "Optimizer: sgd over" in log and 0 <= accuracy(log) <= 100
    assert re.search(r"# classes\s+4\n", log)  # DTD's 7 classes: 4 base
    optim_file = osp.join(ROOT, f"configs/optim/{trainer}/sample.yaml")
    epochs = ("OPTIM.MAX_EPOCH", "2", "OPTIM.SAM.STAGE2_EPOCHS", "1")
    sam_args = train_py_args(dtd_root, sam_out, deep_opts, trainer, config_files, *base, *epochs)
    train_in_process(["--optim-config-file", optim_file, *sam_args])
    log = open(osp.join(sam_out, "log.txt")).read()
    assert "Optimizer: sample(sgd)" in log and "cos_g_gp" in log
    stage2 = "Epoch 3: the sharpness-aware stage starts (stage 2); frozen: MultiModalPromptLearner."
    assert stage2 in log
    ckpt = torch.load(
        osp.join(sam_out, "MultiModalPromptLearner", "model.pth.tar-3"), weights_only=True
    )
    assert set(ckpt["state_dict"]) == names
    new_out = str(tmp_path / "new")
    eval_flags = ["--eval-only", "--model-dir", sam_out, "--load-epoch", "3"]
    new = ("DATASET.SUBSAMPLE_CLASSES", "new", *extra)
    train_in_process(
        eval_flags + train_py_args(dtd_root, new_out, deep_opts, trainer, config_files, *new)
    )
    log = open(osp.join(new_out, "log.txt")).read()
    assert 'Loading weights to MultiModalPromptLearner from "' in log
    assert re.search(r"# classes\s+3\n", log) and 0 <= accuracy(log) <= 100  # 3 new classes


def write_descriptions(folder, classes=DTD_CLASSES, n=3, key="dtd") -> str:
    table = {c: [f"a {c} texture, description number {k}." for k in range(n)] for c in classes}
    path = osp.join(folder, f"{key}_prompt.json")
    with open(path, "w") as f:
        json.dump(table, f)
    return str(folder)


def tiny_options(trainer: str, tmp_path, depth: int) -> list[str]:
    """KEY VALUE options that fit ``trainer`` to a tiny CLIP with ``depth`` prompted blocks,
    derived from its config keys (so a newly registered trainer needs no test edits)."""
    node_name = TRAINER_REGISTRY.get(trainer).config_node()
    node = make_cfg([], trainer=trainer).TRAINER[node_name]
    opts = []
    for key in node:
        full = f"TRAINER.{node_name}.{key}"
        if "DEPTH" in key:  # deep prompts: the blocks the tiny towers have
            opts += [full, str(depth)]
        elif key == "INJECT_LAYER":
            opts += [full, str(depth - 1)]
        elif key == "REP_LAYERS":  # representation tokens (MMRL): every block of the towers
            opts += [full, str(list(range(1, depth + 1)))]
        elif key == "START_LAYER":  # SkipTuning: the frozen blocks before the tuned ones
            opts += [full, str(depth // 2)]
        elif key == "DESCRIPTIONS_DIR":  # a teacher reading class descriptions, two views
            folder = tmp_path / "descriptions"
            folder.mkdir(exist_ok=True)
            opts += [full, write_descriptions(folder)]
            opts += ["DATALOADER.K_TRANSFORMS", "2", "INPUT.TRANSFORMS", "['randaugment']"]
    return opts


def coop_args(root, out, tiny_clip_opts, *extra, seed="1", trainer="CoOp", flags=()):
    """train.py arguments of a small fp32 CoOp run on the DTD layout (4 shots, tiny CLIP)."""
    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    coop = osp.join(ROOT, "configs/trainers/CoOp/vit_b16_ctxv1.yaml")
    return [
        "--root", root, "--seed", seed, "--trainer", trainer, "--dataset-config-file", dtd,
        "--config-file", coop, "--output-dir", out, *flags, *tiny_clip_opts,
        "TRAINER.COOP.PREC", "fp32", "DATASET.NUM_SHOTS", "4", *extra,
    ]  # fmt: skip


def loss_and_grads_of(tr, inputs) -> tuple:
    """``(loss, [grad of each learnable tensor])`` of one pass of ``tr._loss`` on prepared
    ``inputs`` (gradients cleared first)."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss, _ = tr._loss(inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def train_interrupted(tr, epoch: int = 2) -> None:
    """Train ``tr`` until epoch ``epoch`` (0-based) starts, then stop it as Ctrl-C would (the
    epochs before it are saved)."""
    before_epoch = tr.before_epoch

    def interrupt():
        if tr.epoch == epoch:
            raise KeyboardInterrupt
        before_epoch()

    tr.before_epoch = interrupt
    with pytest.raises(KeyboardInterrupt):
        tr.train()


def train_in_process(args: list[str], code: int = 0) -> None:
    """Run ``train.py args`` in this process (engine.runner.run_in_process: the argument parsing,
    run folder, log, checkpoints and numbers of a train.py process, without the seconds of a
    fresh interpreter's imports) and check its exit status. For the tests whose point is the run,
    not the process (exit codes on stderr, signals, locks between processes keep ``run_train``)."""
    from engine.runner import run_in_process

    rc = run_in_process(list(args))
    assert rc == code, f"train.py returned {rc}, expected {code} (its output is printed above)"
