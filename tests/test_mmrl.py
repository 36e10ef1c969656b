"""MMRL (trainers/mmrl.py) against MMRL's own code and on its own.

The differential test compares with the numbers that tests/reference/make_mmrl.py recorded from
MMRL's code (yunncheng/MMRL @ 27d8821, its docstring lists the patches) on the same tiny CLIP,
inputs and initial parameters: the frozen features, both paths' logits and the fused ones, the
loss and its terms, the gradients of every learnable tensor, the parameters after one SGD step
through this project's optimizer step, and the evaluation logits of the decoupled inference,
each within 1e-5 of the largest reference value. The other tests check the token positions, the
per-dataset values, the refusals, every precision with SGD and SAMPLe, and train.py's
base-to-new runs.
"""

from __future__ import annotations

import os.path as osp
import re
import sys

import pytest
import torch
from conftest import ROOT, make_cfg
from helpers import train_in_process

from engine import build_trainer
from engine.clip.toy import TINY_OPTS

sys.path.insert(0, osp.join(ROOT, "tests", "reference"))
import make_mmrl as REF  # noqa: E402  (the generator's settings: one source of truth)

REFERENCE = osp.join(ROOT, "tests", "reference", "mmrl_27d8821.pt")
TOL = 1e-5
S = REF.SETTINGS


@pytest.fixture(scope="module")
def ref():
    return torch.load(REFERENCE, weights_only=True)


@pytest.fixture(scope="module")
def clip_opts(tmp_path_factory, ref):
    cfg_path, ckpt = REF.write_reference_clip(str(tmp_path_factory.mktemp("mmrl_clip")))
    state = torch.load(ckpt, weights_only=True)
    checksum = REF.clip_checksum(state.get("state_dict", state))
    assert checksum == pytest.approx(ref["clip_checksum"], rel=1e-12), "the tiny CLIP changed"
    return ["MODEL.BACKBONE.NAME", "", "MODEL.BACKBONE.CONFIG", cfg_path,
            "MODEL.BACKBONE.PATH", ckpt, *TINY_OPTS]  # fmt: skip


def mmrl_opts(prec="fp32", **over) -> list[str]:
    values = {**S, "PREC": prec, "TASK": "B2N", "DATASET_VALUES": False, **over}
    return [x for k, v in values.items() for x in (f"TRAINER.MMRL.{k}", str(v))]


def reference_cfg(tmp_path, clip_opts, *extra):
    """The reference run's settings: DTD's template, plain SGD (no momentum or decay)."""
    opts = ["--output-dir", str(tmp_path / "out"), *clip_opts, *mmrl_opts()]
    opts += ["OPTIM.NAME", "sgd", "OPTIM.LR", str(REF.LR), "OPTIM.MOMENTUM", "0.0"]
    opts += ["OPTIM.WEIGHT_DECAY", "0.0", "OPTIM.WARMUP_EPOCH", "0", "OPTIM.MAX_EPOCH", "1"]
    opts += ["DATASET.SUBSAMPLE_CLASSES", "base", "TEST.NO_TEST", "True", *extra]
    return make_cfg(opts, trainer="MMRL")


def reference_trainer(tmp_path, clip_opts, ref, *extra):
    tr = build_trainer(reference_cfg(tmp_path, clip_opts, *extra), classnames=REF.CLASSNAMES)
    tr.model.learner.load_state_dict(ref["initial"])
    return tr


def inputs():
    torch.manual_seed(REF.IMAGE_SEED)
    return torch.randn(4, 3, 32, 32), torch.tensor(REF.LABELS)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max())


def check(name, ours, want, report):
    report[name] = max(report.get(name, 0.0), rel(ours, want))
    assert report[name] <= TOL, f"{name}: relative difference {report[name]:.2e}"


@pytest.mark.parametrize(
    "full_length",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["truncated", "full_length"],
)
def test_equal_to_mmrls_code(full_length, tmp_path, clip_opts, ref):
    """Ours vs MMRL's code: every quantity within 1e-5 (relative to its largest value)."""
    if full_length:
        tr = reference_trainer(tmp_path, clip_opts, ref, "MODEL.TEXT_FULL_LENGTH", "True")
        assert tr.model.prompt_embeddings.shape[1] == 77
    else:
        tr = reference_trainer(tmp_path, clip_opts, ref)
        assert tr.model.prompt_embeddings.shape[1] < 77
    report: dict[str, float] = {}
    image, label = inputs()
    model = tr.model
    check("zs_text_features", model.zs_text_features, ref["zs_text_features"], report)
    prepared = tr.prepare_step((image, label))
    check("zs_image_features", prepared[2], ref["zs_image_features"], report)
    # logits of both paths and the fused ones
    tokens = model.learner()
    f, f_r, g = model.encode(image, tokens)
    logits, logits_rep = model.logits(f, g), model.logits(f_r, g)
    check("logits", logits, ref["logits"], report)
    check("logits_rep", logits_rep, ref["logits_rep"], report)
    fused = S["ALPHA"] * logits + (1 - S["ALPHA"]) * logits_rep
    check("logits_fusion", fused, ref["logits_fusion"], report)
    # the loss, its terms and the gradients
    loss, summary = tr.compute_loss(prepared)
    check("loss", loss, ref["loss"], report)
    for k, v in ref["terms"].items():
        check(f"term {k}", summary[k], v, report)
    learner = model.learner
    learner.zero_grad()
    loss.backward()
    grads = dict(learner.named_parameters())
    assert set(grads) == set(ref["grads"])
    for k, v in ref["grads"].items():
        assert grads[k].grad is not None and grads[k].grad.abs().sum() > 0, k
        check(f"grad {k}", grads[k].grad, v, report)
    learner.zero_grad()
    # one SGD step through the engine's optimizer step
    tr.batch_idx = 0
    out = tr.forward_backward({"img": image, "label": label})
    check("step loss", out["loss"], ref["loss"], report)
    state = learner.state_dict()
    for k, v in ref["after"].items():
        assert not torch.equal(state[k], ref["initial"][k]), k
        check(f"after {k}", state[k], v, report)
    # the decoupled inference (MMRL's test()): base classes -> fused, new classes -> class token
    tr.set_model_mode("eval")
    with torch.no_grad():
        tr.before_test()
        check("eval fused (base)", tr.model_inference(image), ref["eval_fusion"], report)
        tr.cfg.defrost()
        tr.cfg.DATASET.SUBSAMPLE_CLASSES = "new"
        check("eval class token (new)", tr.model_inference(image), ref["eval_logits"], report)
        tr.after_test()
    print(
        f"\nMMRL vs MMRL's code ({'full' if full_length else 'truncated'} prompts), largest "
        "relative differences:\n" + "\n".join(f"  {k}: {v:.2e}" for k, v in report.items())
    )


def test_tokens_enter_the_right_blocks_at_the_right_positions(tmp_path, clip_opts, ref):
    tr = reference_trainer(tmp_path, clip_opts, ref)
    model, n = tr.model, S["N_REP_TOKENS"]
    tokens = model.learner()
    seen = {"text": {}, "vision": {}}
    handles = []
    towers = {
        "text": model.text_encoder.transformer.resblocks,
        "vision": model.image_encoder.visual.transformer.resblocks,
    }
    for tower, blocks in towers.items():
        for i, block in enumerate(blocks):

            def pre(_, args, kwargs, i=i, tower=tower):
                seen[tower][i] = (args[0].detach().clone(), kwargs.get("attn_mask"))

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
    image, _ = inputs()
    with torch.no_grad():
        model.text_features(tokens.text)
        model.image_features(image, tokens.vision)
    for h in handles:
        h.remove()
    seq = model.prompt_embeddings.shape[1]
    # blocks 1 (layer 1): no tokens; layer 2 (block index 1) inserts, layer 4 replaces
    assert seen["text"][0][0].shape[1] == seq and seen["vision"][0][0].shape[1] == 17
    for tower, width in (("text", seq), ("vision", 17)):
        for i in (1, 2, 3):
            assert seen[tower][i][0].shape[1] == width + n
    for k, i in enumerate((1, 3)):  # REP_LAYERS [2, 4]
        assert torch.equal(seen["text"][i][0][0, 1 : 1 + n], tokens.text[k].detach())
        assert torch.equal(seen["vision"][i][0][1, 1 : 1 + n], tokens.vision[k].detach())
    # the causal mask grows with the tokens from the first representation layer on
    mask = seen["text"][1][1]
    assert mask.shape == (seq + n, seq + n) and torch.isinf(mask[0, 1]) and mask[1, 0] == 0
    assert seen["text"][0][1].shape == (seq, seq)
    with pytest.raises(ValueError, match="REP_LAYERS"):
        build_trainer(reference_cfg(tmp_path, clip_opts, "TRAINER.MMRL.REP_LAYERS", "[2, 5]"),
                      classnames=REF.CLASSNAMES)  # fmt: skip


def test_decoupled_inference_per_task(tmp_path, clip_opts, ref):
    tr = reference_trainer(tmp_path, clip_opts, ref)
    cases = [  # (TASK, dataset, SUBSAMPLE_CLASSES) -> fused?
        ("B2N", "DescribableTextures", "base", True), ("B2N", "DescribableTextures", "new", False),
        ("B2N", "DescribableTextures", "all", False), ("FS", "DescribableTextures", "all", True),
        ("CD", "ImageNet", "all", True), ("CD", "DescribableTextures", "all", False),
        ("CD", "ImageNetV2", "all", False),
    ]  # fmt: skip
    image, _ = inputs()
    tr.set_model_mode("eval")
    with torch.no_grad():
        tr.before_test()
        tokens = tr.model.learner()
        f, f_r, g = tr.model.encode(image, tokens)
        z, z_r = tr.model.logits(f, g), tr.model.logits(f_r, g)
        for task, dataset, sub, fused in cases:
            tr.cfg.defrost()
            tr.cfg.TRAINER.MMRL.TASK, tr.cfg.DATASET.NAME = task, dataset
            tr.cfg.DATASET.SUBSAMPLE_CLASSES = sub
            assert tr.uses_fused_logits() is fused, (task, dataset, sub)
            want = S["ALPHA"] * z + (1 - S["ALPHA"]) * z_r if fused else z
            torch.testing.assert_close(tr.model_inference(image), want, rtol=1e-5, atol=1e-5)
            if dataset == "ImageNet" or sub == "new":  # one fused and one class-token case
                out = tr.model_outputs(image).logits
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        tr.after_test()


def test_mmrls_keys_and_per_dataset_values():
    # MMRL's top-level TASK is read as TRAINER.MMRL.TASK; its per-dataset values apply over the
    # files for B2N and FS, and the command line wins
    b2n = "configs/trainers/MMRL/vit_b16.yaml"
    c = make_cfg(["TASK", "FS"], trainer="MMRL", dataset_cfg="configs/datasets/eurosat.yaml",
                 config_file=b2n)  # fmt: skip
    n = c.TRAINER.MMRL
    assert (n.TASK, n.REG_WEIGHT, n.REP_DIM) == ("FS", 0.01, 2048)
    c = make_cfg(["TRAINER.MMRL.REG_WEIGHT", "3.0"], trainer="MMRL", config_file=b2n,
                 dataset_cfg="configs/datasets/stanford_cars.yaml")  # fmt: skip
    assert c.TRAINER.MMRL.REG_WEIGHT == 3.0
    c = make_cfg([], trainer="MMRL", config_file=b2n,
                 dataset_cfg="configs/datasets/stanford_cars.yaml")  # fmt: skip
    assert c.TRAINER.MMRL.REG_WEIGHT == 7.0
    c = make_cfg(["TRAINER.MMRL.DATASET_VALUES", "False"], trainer="MMRL", config_file=b2n,
                 dataset_cfg="configs/datasets/stanford_cars.yaml")  # fmt: skip
    assert c.TRAINER.MMRL.REG_WEIGHT == 1.0
    xd = "configs/trainers/MMRL/vit_b16_cross_datasets.yaml"
    for data in ("imagenet", "eurosat"):  # CD: the published 0.2 and 512 everywhere
        c = make_cfg([], trainer="MMRL", dataset_cfg=f"configs/datasets/{data}.yaml",
                     config_file=xd)  # fmt: skip
        n = c.TRAINER.MMRL
        assert (n.TASK, n.REG_WEIGHT, n.REP_DIM, c.OPTIM.MAX_EPOCH) == ("CD", 0.2, 512, 1)
    # the published configs
    for name, batch, epochs, reg, task in (
        ("vit_b16", 4, 10, 1.0, "B2N"), ("vit_b16_imagenet", 32, 5, 1.0, "B2N"),
        ("vit_b16_few_shot", 32, 50, 0.5, "FS"),
    ):  # fmt: skip
        c = make_cfg(["TRAINER.MMRL.DATASET_VALUES", "False"], trainer="MMRL",
                     config_file=f"configs/trainers/MMRL/{name}.yaml")  # fmt: skip
        o, n = c.OPTIM, c.TRAINER.MMRL
        assert (c.DATALOADER.TRAIN_X.BATCH_SIZE, o.NAME, o.LR, o.MAX_EPOCH) == (
            batch, "adamw", 0.001, epochs)  # fmt: skip
        assert (n.ALPHA, n.REG_WEIGHT, n.N_REP_TOKENS, n.REP_DIM, n.PREC, n.TASK) == (
            0.7, reg, 5, 512, "amp", task)  # fmt: skip
        assert list(n.REP_LAYERS) == [6, 7, 8, 9, 10, 11, 12]
    # TASK with another trainer: MMRL's key, named with the command that reads it
    with pytest.raises(ValueError, match="--trainer MMRL"):
        make_cfg(["TASK", "B2N"], trainer="MaPLe")


def test_bad_settings_are_refused(tmp_path, clip_opts):
    cases = [
        ("TRAINER.MMRL.ALPHA", "1.5", "TRAINER.MMRL.ALPHA"),
        ("TRAINER.MMRL.REP_LAYERS", "[3, 2]", "increasing"),
        ("TRAINER.MMRL.TASK", "XD", "TRAINER.MMRL.TASK"),
        ("MODEL.TEXT_CHUNK", "2", "MODEL.TEXT_CHUNK"),
    ]
    for key, value, message in cases:
        cfg = make_cfg([*clip_opts, *mmrl_opts(), key, value], trainer="MMRL")
        with pytest.raises(ValueError, match=message):
            build_trainer(cfg, classnames=REF.CLASSNAMES)
    rn = make_cfg([*mmrl_opts(), "MODEL.BACKBONE.NAME", "RN50"], trainer="MMRL")
    with pytest.raises(ValueError, match="ViT image encoder"):
        build_trainer(rn, classnames=REF.CLASSNAMES)


# ----------------------------------------------------------------------------------------------
# every precision with SGD and SAMPLe; checkpoints; train.py
# ----------------------------------------------------------------------------------------------
LEARNABLE = set(REF.LEARNABLE.values())


@pytest.mark.parametrize("optim", ["", "sample"])
def test_one_step_trains_every_tensor(optim, tmp_path, dtd_root_shared, clip_opts):
    """fp32 with SGD and SAMPLe (every precision x optimizer: tests/test_trainer_matrix.py)."""
    prec = "fp32"
    flags = ["--optim-config-file", osp.join(ROOT, f"configs/optim/MMRL/{optim}.yaml")]
    opts = (flags if optim else []) + ["--root", dtd_root_shared, "--seed", "1"]
    opts += ["--output-dir", str(tmp_path / "out"), *clip_opts, *mmrl_opts(prec)]
    opts += ["DATASET.NUM_SHOTS", "2", "OPTIM.NAME", "sgd", "OPTIM.LR", "0.01"]
    opts += ["OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCH", "0", "TEST.NO_TEST", "True"]
    tr = build_trainer(make_cfg(opts, trainer="MMRL"))
    assert set(tr.model.learner.state_dict()) == LEARNABLE
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable == {f"learner.{n}" for n in LEARNABLE}
    tr.before_train()
    tr.before_epoch()
    params = list(tr.model.learner.parameters())
    before = [p.detach().clone() for p in params]
    batch = next(iter(tr.train_loader_x))
    tr.batch_idx = 0
    out = tr.forward_backward(batch)
    assert torch.isfinite(out["loss"]) and "reg_text" in out
    tr.close_writer()
    for b, p in zip(before, params, strict=True):
        assert p.dtype == torch.float32 and torch.isfinite(p).all() and not torch.equal(b, p)
    if optim:
        assert "grad_norm" in out  # the two-pass step ran
    tr.save_model(0, str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / "MultiModalRepresentationLearner" / "model.pth.tar-1"
    assert set(torch.load(path, weights_only=True)["state_dict"]) == LEARNABLE


def test_mmrls_checkpoint_loads(tmp_path, clip_opts, ref):
    """A checkpoint in MMRL's layout (its whole CustomCLIP state dict) loads for evaluation."""
    tr = reference_trainer(tmp_path, clip_opts, ref)
    theirs = {old: ref["after"][new] for old, new in REF.LEARNABLE.items()}
    theirs["prompt_embeddings"] = torch.zeros(3, 77, 64)
    theirs["image_encoder.proj"] = torch.zeros(64, 32)
    theirs["text_encoder.text_projection"] = torch.zeros(64, 32)
    folder = tmp_path / "theirs" / "MultiModalRepresentationLearner"
    folder.mkdir(parents=True)
    torch.save({"state_dict": theirs, "epoch": 5}, folder / "model.pth.tar-5")
    tr.load_model(str(tmp_path / "theirs"))  # no --load-epoch: the newest, as MMRL's scripts
    state = tr.model.learner.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ref["after"].items())


def accuracy(log: str) -> float:
    return float(re.findall(r"\* accuracy: ([\d.]+)%", log)[-1])


@pytest.mark.slow
def test_train_py_base_to_new(tmp_path, dtd_root, clip_opts):
    """MMRL's base-to-new scripts' command lines (top-level TASK, its published config) with
    SGD and with SAMPLe (amp), then the new classes from the SAMPLe run's checkpoint."""

    def args(out, *extra):
        return ["--root", dtd_root, "--seed", "1", "--trainer", "MMRL",
                "--dataset-config-file", osp.join(ROOT, "configs/datasets/dtd.yaml"),
                "--config-file", osp.join(ROOT, "configs/trainers/MMRL/vit_b16.yaml"),
                "--output-dir", out, *clip_opts, "TRAINER.MMRL.REP_LAYERS", "[2, 4]",
                "TRAINER.MMRL.REP_DIM", "16", "DATASET.NUM_SHOTS", "2", "OPTIM.MAX_EPOCH", "1",
                *extra]  # fmt: skip

    sgd, sam, new = (str(tmp_path / d) for d in ("sgd", "sample", "new"))
    base = ("DATASET.SUBSAMPLE_CLASSES", "base", "TASK", "B2N")
    train_in_process(args(sgd, "TRAINER.MMRL.PREC", "fp32", *base))
    log = open(osp.join(sgd, "log.txt")).read()
    assert "Optimizer: adamw over" in log and 0 <= accuracy(log) <= 100
    assert "TRAINER.MMRL.REG_WEIGHT 1.0 -> 6.0" in log  # MMRL's DTD value
    assert re.search(r"# classes\s+4\n", log)
    optim = osp.join(ROOT, "configs/optim/MMRL/sample.yaml")
    train_in_process(["--optim-config-file", optim, *args(sam, *base)])
    log = open(osp.join(sam, "log.txt")).read()
    assert "Optimizer: sample(adamw)" in log and "reg_image" in log
    eval_flags = ["--eval-only", "--model-dir", sam]  # no --load-epoch, as MMRL's test script
    train_in_process([*eval_flags, *args(new, "DATASET.SUBSAMPLE_CLASSES", "new", "TASK", "B2N")])
    log = open(osp.join(new, "log.txt")).read()
    assert 'Loading weights to MultiModalRepresentationLearner from "' in log
    assert "loading epoch 1, as MMRL does" in log
    assert re.search(r"# classes\s+3\n", log) and 0 <= accuracy(log) <= 100


def test_tables_compare_with_the_published_average(tmp_path):
    """MMRL's runs join the base-to-new tables with its paper's average (HM 81.20) beside them."""
    from run_folders import fake_base2new

    from experiments.paper_results import BASE2NEW_DATASETS
    from experiments.protocols import Setup
    from tools import make_tables

    out = str(tmp_path / "output")
    for d in BASE2NEW_DATASETS:
        fake_base2new(Setup(output=out), "MMRL", "sgd", d, (1,), accuracy=lambda m, s: 80.0)
    argv = ["--output", out, "--tables", "base2new", "--trainers", "MMRL", "--optims", "sgd"]
    average = make_tables.build_tables(make_tables.build_parser().parse_args(argv))[0]
    assert average.title == "Base-to-new: average over 11 datasets"
    (row,) = average.rows
    assert row[0] == "MMRL" and [c.paper for c in row[1:]] == [85.68, 77.16, 81.20]
    assert [c.value for c in row[1:]] == pytest.approx([80.0, 80.0, 80.0])
