"""SkipTuning (trainers/skiptuning.py) against the authors' code, and end to end.

The reference numbers (tests/reference/skiptuning.pt) come from the authors' own code
(Koorye/SkipTuning at 8c4636e) run by tests/reference/make_skiptuning.py on the same tiny
deterministic CLIP (its docstring lists the patches needed to run it on a CPU). Every quantity
agrees within 1e-5 relative: the frozen lower-block features, the class prototypes, the keep
probabilities, a training step's kept classes, labels, logits and loss, the gradients of every
tuned tensor, one SGD step with the authors' staged learning rates, the evaluation logits after
it, a training forward with token dropping, and the feature loader's batches.
"""

from __future__ import annotations

import hashlib
import os.path as osp
import random

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import train_in_process

from engine import build_trainer
from engine.clip.toy import TINY_OPTS, write_tiny_clip
from engine.errors import CheckpointError, ConfigError
from trainers.skiptuning import (
    SkipInputs,
    feature_batches,
    keep_probabilities,
    num_top_classes,
    relabel,
)

REF_PATH = osp.join(ROOT, "tests", "reference", "skiptuning.pt")
TOL = 1e-5  # relative to the largest magnitude of the reference quantity
UPDATE_TOL = 2e-2  # a step's update (a difference of fp32 parameters): see its comparison
MEASURED: dict[str, float] = {}  # quantity -> largest relative difference (printed with -s)


@pytest.fixture(scope="module")
def ref():
    return torch.load(REF_PATH, weights_only=False)


def digest(state: dict) -> str:
    h = hashlib.sha1()
    for k in sorted(state):
        t = state[k].detach().float().contiguous().cpu()
        h.update(f"{k}|{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def projected(t: torch.Tensor, name: str, like: dict) -> dict:
    """``t`` summarised as the generator summarised the reference (make_skiptuning.summary)."""
    t = t.detach().double().cpu()
    if "full" in like:
        return {"full": t}
    seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
    dirs = torch.randn(len(like["proj"]), t.numel(), generator=torch.Generator().manual_seed(seed))
    return {"sum": t.sum(), "norm": t.norm(), "proj": dirs.double() @ t.flatten()}


def close(name: str, ours, theirs, tol: float = TOL) -> None:
    """Assert agreement within ``tol`` relative to the reference's largest magnitude (a large
    tensor: its norm and random projections; its sum, which cancels, is not compared)."""
    if isinstance(theirs, dict):
        ours = projected(ours, name, theirs)
        for key in theirs:
            if key != "sum":
                close(f"{name}.{key}", ours[key], theirs[key], tol)
        return
    a = torch.as_tensor(ours).detach().double().cpu()
    b = torch.as_tensor(theirs).double().cpu()
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs the authors' {tuple(b.shape)}"
    rel = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
    group = name.split(".")[0]
    MEASURED[group] = max(MEASURED.get(group, 0.0), rel)
    assert rel <= tol, f"{name}: relative difference {rel:.2e} > {tol}"


@pytest.fixture(scope="module")
def trainer(ref, tmp_path_factory):
    """The project's trainer on the reference's tiny CLIP (fp32, full-length prompts)."""
    c = ref["config"]
    folder = str(tmp_path_factory.mktemp("skip_ref_clip"))
    cfg_path, ckpt = write_tiny_clip(folder, config=c["tiny"], seed=c["seed"])
    state = torch.load(ckpt)
    state = {k: v.half().float() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(state, ckpt)  # fp16 values, as OpenAI's build_model stores them (the generator)
    if digest(state) != ref["weights_sha1"]:
        pytest.fail(
            "The tiny CLIP's weights differ from the reference's (another torch version?): "
            "regenerate tests/reference/skiptuning.pt with tests/reference/make_skiptuning.py"
        )
    skip, optim = c["skip"], c["optim"]
    opts = ["--seed", "1", "MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path]
    opts += ["MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS, "TRAINER.SKIP.PREC", "fp32"]
    for key, value in skip.items():
        opts += [f"TRAINER.SKIP.{key}", str(value)]
    opts += ["TRAINER.SKIP.NEW_LR", str(optim["NEW_LR"]), "OPTIM.STAGED_LR", "True"]
    opts += ["OPTIM.NAME", "sgd", "OPTIM.LR", str(optim["LR"]), "OPTIM.WARMUP_EPOCH", "0"]
    opts += ["OPTIM.WEIGHT_DECAY", str(optim["WEIGHT_DECAY"])]
    opts += ["OPTIM.MOMENTUM", str(optim["MOMENTUM"])]
    opts += ["MODEL.TEXT_FULL_LENGTH", "True"]  # the authors' 77-token prompts (same features)
    tr = build_trainer(make_cfg(opts, trainer="SkipTuning"), classnames=c["classnames"])
    tr.model.rank_mask = ref["reserve_mask"].clone()  # their draw (generator seeds differ)
    return tr


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_equal_to_the_authors_code(ref, trainer):
    tr, c = trainer, ref["config"]
    model = tr.model
    assert model.template.format("x") == "itap of a x."  # their DTD template
    imgs, labels = images(len(c["labels"])), torch.tensor(c["labels"])
    with torch.no_grad():
        mid = model.image_lower(imgs)  # [batch, tokens, width]
    close("image_mid", mid, ref["image_mid"])
    close("text_mid", model.text_mid, ref["text_mid"])
    close("prototypes", model.prototypes, ref["prototypes"])
    n_cls = len(c["classnames"])
    n_top = num_top_classes(n_cls, c["skip"]["TOP_RATIO"], c["skip"]["MAX_TOP"])
    pdf = ref["pdf"]
    close("keep_probabilities", keep_probabilities(n_cls, n_top, c["skip"]["LAMBDA"])[n_top:],
          (pdf - pdf.min()) / (pdf.max() - pdf.min()))  # fmt: skip

    # one training pass: kept classes, labels, logits, loss, gradients
    tr.set_model_mode("train")
    inputs = tr.prepare_step((mid, labels))
    params = dict(model.learnable.named_parameters())
    assert sorted(params) == ref["trained"]  # the same tensors tuned, under the same names
    loss, _ = tr._loss(inputs)
    assert torch.equal(inputs.choice["classes"], ref["train"]["classes"])
    assert torch.equal(relabel(labels, inputs.choice["classes"], n_cls), ref["train"]["target"])
    close("logits", tr._pass_outputs.logits, ref["train"]["logits"])
    close("loss", loss, ref["train"]["loss"])
    loss.backward()
    for name, p in params.items():
        close(f"grad.{name}", p.grad, ref["grads"][name])
        p.grad = None

    # one step of the engine's optimizer step (SGD, the authors' staged LRs), then evaluation
    before = {k: p.detach().clone() for k, p in params.items()}
    batch = {"features": mid, "label": labels, "index": torch.arange(len(labels))}
    tr.batch_idx = 0
    tr.forward_backward(batch)
    for name, p in params.items():
        close(f"after.{name}", p, ref["after"][name])
        # the update p_after - p_before in fp32 loses digits to the subtraction (an ulp of a
        # LayerNorm weight of 1.0 is 6e-3 of its update here): compared at UPDATE_TOL
        close(f"update.{name}", p.detach() - before[name], ref["update"][name], UPDATE_TOL)
    tr.set_model_mode("eval")
    with torch.no_grad():
        close("eval_logits", tr.model_outputs(imgs).logits, ref["eval_logits"])
    for name, p in params.items():  # back to the reference weights for the next test
        p.data.copy_(before[name])


def test_token_drop_and_loader_equal_to_the_authors(ref, trainer):
    tr, c = trainer, ref["config"]
    drop = c["drop"]
    imgs, labels = images(len(c["labels"])), torch.tensor(c["labels"])
    with torch.no_grad():
        mid = tr.model.image_lower(imgs)
    cfg = tr.cfg.clone()
    cfg.defrost()
    cfg.TRAINER.SKIP.DROP_RATIO = drop["RATIO"]
    tr.cfg = cfg
    try:
        tr._rng = random.Random(drop["SEED"])  # their random.seed / torch.manual_seed draws
        tr._torch_rng = torch.Generator().manual_seed(drop["SEED"])
        inputs = tr.prepare_step((mid, labels))
        keep = ref["drop"]["keep"]
        assert inputs.features.shape[1] == int(keep.sum()) < mid.shape[1]
        assert torch.equal(inputs.features, mid[:, keep])
        with torch.no_grad():
            loss, _ = tr._loss(inputs)
        close("drop_logits", tr._pass_outputs.logits, ref["drop"]["logits"])
        close("drop_loss", loss, ref["drop"]["loss"])
    finally:
        cfg.TRAINER.SKIP.DROP_RATIO = 0.0
        del tr._rng, tr._torch_rng
    for by_class, mode in ((True, "batch_random"), (False, "random")):
        rng = random.Random(c["loader_seed"])
        assert feature_batches(c["loader_labels"], 4, by_class, rng) == ref["loader_batches"][mode]
    print("\nSkipTuning vs the authors' code, largest relative differences:", MEASURED)


def test_a_step_keeps_its_class_choice_for_every_pass(trainer):
    """A two-pass optimizer evaluates the same classes in both passes: the choice is made
    once per step (inputs.choice) and shared with subsets."""
    tr = trainer
    imgs, labels = images(4), torch.tensor([0, 1, 1, 6])
    with torch.no_grad():
        inputs = tr.prepare_step((tr.model.image_lower(imgs), labels))
        tr._loss(inputs)
        classes = inputs.choice["classes"].clone()
        sub = tr.select_inputs(inputs, torch.tensor([0, 3]), 4)
        assert isinstance(sub, SkipInputs) and sub.choice is inputs.choice
        for p in tr.model.learnable.parameters():  # other weights would choose otherwise
            p.add_(torch.randn_like(p))
        tr._loss(sub)
    assert torch.equal(inputs.choice["classes"], classes)
    assert set(labels.tolist()) <= set(classes.tolist())


def test_saf_refused_while_classes_are_skipped(ref, trainer):
    """SAF's trajectory term needs logits over the same classes in every step."""
    cfg = trainer.cfg.clone()
    cfg.defrost()
    cfg.OPTIM.SAM.NAME = "saf"
    with pytest.raises(ConfigError, match="TOP_RATIO 1.0"):
        build_trainer(cfg, classnames=ref["config"]["classnames"])


@pytest.mark.slow
def test_train_base_then_new_with_sample(tmp_path, dtd_root, deep_opts):
    """train.py: SkipTuning with SAMPLe on the base classes, then evaluation on the new ones
    from the checkpoint (tuned tensors only)."""
    dtd = osp.join(ROOT, "configs/datasets/dtd.yaml")
    cfg = osp.join(ROOT, "configs/trainers/SkipTuning/vit_b16_bs4.yaml")
    sample = osp.join(ROOT, "configs/optim/SkipTuning/sample.yaml")
    common = ["--root", dtd_root, "--seed", "1", "--trainer", "SkipTuning"]
    common += ["--dataset-config-file", dtd, "--config-file", cfg, *deep_opts]
    common += ["TRAINER.SKIP.START_LAYER", "2", "TRAINER.SKIP.PREC", "fp32"]
    common += ["DATASET.NUM_SHOTS", "4", "TRAINER.SKIP.QUICK_BATCH_SIZE", "8"]
    train_dir, test_dir = str(tmp_path / "train"), str(tmp_path / "test")
    train_in_process([*common, "--optim-config-file", sample, "--output-dir", train_dir,
                      "OPTIM.MAX_EPOCH", "1", "OPTIM.SAM.START_EPOCH", "0",
                      "DATASET.SUBSAMPLE_CLASSES", "base"])  # fmt: skip
    log = open(osp.join(train_dir, "log.txt")).read()
    assert "Finish training" in log and "accuracy" in log and "sample" in log.lower()
    state = torch.load(osp.join(train_dir, "learnable_params", "model.pth.tar-1"))["state_dict"]
    assert "text_encoder.transformer.resblocks.2.attn.in_proj_weight" in state
    assert not any("resblocks.1." in k or "conv1" in k or "token_embedding" in k for k in state)
    train_in_process([*common, "--output-dir", test_dir, "--model-dir", train_dir,
                      "--load-epoch", "1", "--eval-only",
                      "DATASET.SUBSAMPLE_CLASSES", "new"])  # fmt: skip
    assert "accuracy" in open(osp.join(test_dir, "log.txt")).read()


def test_authors_keys_epochs_and_published_number(tmp_path, deep_opts):
    """The authors' OPTIM.NEW_LR / TRAINER.PREC keys are read as TRAINER.SKIP's; ImageNet,
    SUN397 and Food101 train MAX_EPOCH / 4 epochs; the published HM is the comparison value."""
    from experiments.paper_results import paper_value
    from trainers.skiptuning import SkipTuning

    config = "configs/trainers/SkipTuning/vit_b16_bs4.yaml"
    opts = [*deep_opts, "OPTIM.NEW_LR", "7e-6", "TRAINER.PREC", "fp32"]
    cfg = make_cfg(opts, trainer="SkipTuning", config_file=config)
    assert cfg.TRAINER.SKIP.NEW_LR == 7e-6 and cfg.TRAINER.SKIP.PREC == "fp32"
    assert cfg.OPTIM.STAGED_LR and cfg.OPTIM.LR == 2e-5 and cfg.OPTIM.MAX_EPOCH == 20
    opts += ["TRAINER.SKIP.START_LAYER", "2"]
    for dataset, epochs in (("imagenet", 5), ("dtd", 20)):
        cfg = make_cfg(opts, "SkipTuning", f"configs/datasets/{dataset}.yaml", config)
        tr = build_trainer(cfg, classnames=["a", "b", "c"])
        assert tr.max_epoch == epochs == tr.cfg.OPTIM.MAX_EPOCH
        lrs = [g["lr"] for g in tr.optim.param_groups]  # text 2e-5, image NEW_LR (warm-up 1e-6)
        assert tr.optim.param_groups[1]["initial_lr"] == 7e-6 and len(lrs) == 2
    assert SkipTuning.PROTOCOL_CFGS["base2new"] == "vit_b16_bs4"
    assert paper_value("base2new", "SkipTuning", "sgd", "average", "hm") == 81.11


def test_an_authors_checkpoint_loads(tmp_path, ref, trainer):
    """The authors' checkpoints (both encoders whole, under learnable_params/) load: the tuned
    tensors into the model, the frozen ones checked against this CLIP."""
    tr = trainer
    own = {k: v.detach().clone() for k, v in tr.model.learnable.state_dict().items()}
    state = {k: v.detach().clone() for k, v in tr.frozen_tensors().items()}
    state |= {k: v + 0.5 for k, v in own.items()}  # "trained"
    folder = tmp_path / "run" / "learnable_params"
    folder.mkdir(parents=True)
    torch.save({"state_dict": state, "epoch": 20}, folder / "model.pth.tar-20")
    try:
        tr.load_model(str(tmp_path / "run"), epoch=20)
        for k, v in tr.model.learnable.state_dict().items():
            assert torch.equal(v, own[k] + 0.5)
        state["text_encoder.transformer.resblocks.0.ln_1.weight"] += 1.0  # another START_LAYER
        torch.save({"state_dict": state, "epoch": 20}, folder / "model.pth.tar-20")
        with pytest.raises(CheckpointError, match="START_LAYER"):
            tr.load_model(str(tmp_path / "run"), epoch=20)
    finally:
        tr.model.learnable.load_state_dict(own)
