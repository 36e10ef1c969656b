"""CoPrompt (trainers/coprompt.py) on the 4-block tiny CLIP of test_maple (prompts in 3 blocks),
with small description files written by the tests."""

from __future__ import annotations

import fnmatch
import glob
import json
import os.path as osp
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_cfg
from helpers import (
    PROJECTIONS,
    PROMPTS,
    build,
    check_base_to_new,
    check_staged,
    staged_run,
    write_descriptions,
)

from datasets.synthetic import DTD_CLASSES
from engine.clip import encode_texts, tokenize
from trainers.coprompt import class_descriptions, read_descriptions
from trainers.maple import MaPLeCLIP

MAIN_CFG = "configs/trainers/CoPrompt/vit_b16_c2_ep8_batch4_2ctx.yaml"
ADAPTERS = {f"{a}_adapter.{i}.weight" for a in ("image", "text") for i in (0, 2)}
LEARNABLE = {f"prompt_learner.{n}" for n in PROMPTS | PROJECTIONS} | ADAPTERS
N_DESC = 3
SHARED_DESCRIPTIONS = osp.join(ROOT, "..", "shared", "data", "coprompt_descriptions")


@pytest.fixture
def desc_dir(tmp_path):
    folder = tmp_path / "descriptions"
    folder.mkdir()
    return write_descriptions(folder)


def coprompt(tmp_path, dtd_root, deep_opts, desc_dir, *extra, prec="fp32", optim_file=""):
    views = ["DATALOADER.K_TRANSFORMS", "2", "INPUT.TRANSFORMS", "['randaugment', 'normalize']"]
    return build(tmp_path, dtd_root, deep_opts, *views,
                 "TRAINER.COPROMPT.DESCRIPTIONS_DIR", desc_dir, *extra,
                 trainer="CoPrompt", prec=prec, optim_file=optim_file)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def test_trains_prompts_and_adapters_only_and_checkpoints_them(
    tmp_path, dtd_root, deep_opts, desc_dir
):
    tr = coprompt(tmp_path, dtd_root, deep_opts, desc_dir)
    learnable = dict(tr.model.learnable.named_parameters())
    assert set(learnable) == LEARNABLE
    assert learnable["image_adapter.0.weight"].shape == (8, 32)  # 32 -> 32 / 4 -> 32
    trainable = {id(p) for p in tr.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in learnable.values()}
    images = next(iter(tr.test_loader))["img"]
    with torch.no_grad():
        assert tr.model(images).shape == (images.shape[0], tr.num_classes)
    tr.model.set_descriptions(class_descriptions(tr.cfg, tr.dm.dataset.classnames))
    tr.save_model(0, str(tmp_path / "ckpt"))
    path = osp.join(tmp_path, "ckpt", "MultiModalPromptLearner", "model.pth.tar-1")
    assert set(torch.load(path, weights_only=True)["state_dict"]) == LEARNABLE


def test_adapters_mix_residually_before_the_norm(tmp_path, dtd_root, deep_opts, desc_dir):
    tr = coprompt(tmp_path, dtd_root, deep_opts, desc_dir)
    model, learner = tr.model, tr.model.learnable
    images = next(iter(tr.test_loader))["img"][:3]
    with torch.no_grad():
        for p in learner.parameters():  # adapters with non-zero outputs
            p.add_(0.1 * torch.randn_like(p))
        prompts = model.prompt_learner()
        text = MaPLeCLIP.text_features(model, prompts)
        image = MaPLeCLIP.image_features(model, images, prompts)
        want_text = 0.2 * learner.text_adapter(text) + 0.8 * text
        want_image = 0.1 * learner.image_adapter(image) + 0.9 * image
        assert torch.allclose(model.text_features(prompts), want_text)
        assert torch.allclose(model.image_features(images, prompts), want_image)
        assert torch.allclose(model.encode_text(prompts), F.normalize(want_text, dim=-1))
        # the teacher is the plain, unprompted CLIP
        plain = F.normalize(model.image_encoder.visual(images), dim=-1)
        assert torch.equal(model.teacher_image_features(images), plain)


# ----------------------------------------------------------------------------------------------
# The teachers and the loss
# ----------------------------------------------------------------------------------------------
def test_description_index_is_drawn_once_per_step_for_both_passes(
    tmp_path, dtd_root, deep_opts, desc_dir
):
    tr = coprompt(tmp_path, dtd_root, deep_opts, desc_dir, "OPTIM.SAM.NAME", "sample")
    draws, seen = [], []
    draw, compute = tr.draw_description_index, tr.compute_loss

    def recording_draw():
        draws.append(draw())
        return draws[-1]

    def recording_loss(inputs):
        index = inputs["description_index"]
        assert torch.equal(inputs["text_teacher"], tr.model.description_features[:, index])
        seen.append(index)
        return compute(inputs)

    tr.draw_description_index, tr.compute_loss = recording_draw, recording_loss
    tr.train()
    assert len(draws) == len(tr.train_loader_x) and seen == [d for d in draws for _ in (0, 1)]
    # the descriptions were encoded once by the frozen text tower and normalised
    texts = [f"a {c} texture, description number {k}." for c in DTD_CLASSES for k in range(N_DESC)]
    feats = tr.model.description_features
    assert feats.shape == (len(DTD_CLASSES), N_DESC, 32)
    assert torch.allclose(feats.norm(dim=-1), torch.ones(len(DTD_CLASSES), N_DESC))
    want = encode_texts(tr.model.text_encoder, texts).view(len(DTD_CLASSES), N_DESC, -1)
    assert torch.allclose(feats, want, atol=1e-6)


@pytest.mark.parametrize("kind", ["cos", "mse"])
def test_loss_is_ce_plus_weighted_consistency(tmp_path, dtd_root, deep_opts, desc_dir, kind):
    tr = coprompt(tmp_path, dtd_root, deep_opts, desc_dir,
                  "TRAINER.COPROMPT.W", "2.5", "TRAINER.COPROMPT.DISTILL_LOSS", kind)  # fmt: skip
    tr.model.set_descriptions(class_descriptions(tr.cfg, tr.dm.dataset.classnames))
    batch = next(iter(tr.train_loader_x))
    image, image2, label = tr.parse_batch_train(batch)
    assert not torch.equal(image, image2)  # two augmented views
    with torch.no_grad():
        inputs = tr.prepare_step((image, image2, label))
        loss, terms = tr.compute_loss(inputs)
        prompts = tr.model.prompt_learner()
        img, txt = tr.model.encode_image(image, prompts), tr.model.encode_text(prompts)
    t_img = F.normalize(tr.model.image_encoder.visual(image2), dim=-1)
    t_txt = tr.model.description_features[:, inputs["description_index"]]
    if kind == "cos":
        want = (1 - F.cosine_similarity(txt, t_txt).mean()) + (
            1 - F.cosine_similarity(img, t_img).mean()
        )
    else:
        want = F.mse_loss(txt, t_txt) + F.mse_loss(img, t_img)
    assert torch.allclose(inputs["image_teacher"], t_img)
    assert torch.allclose(terms["distill"], want, atol=1e-6)
    logits = tr.model.logits(img, txt)
    assert torch.allclose(terms["ce"], F.cross_entropy(logits, label), atol=1e-6)
    assert torch.allclose(loss, terms["ce"] + 2.5 * want, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Description files
# ----------------------------------------------------------------------------------------------
def test_missing_description_file_names_the_expected_file(tmp_path, dtd_root, deep_opts):
    empty = tmp_path / "empty"
    empty.mkdir()
    tr = coprompt(tmp_path, dtd_root, deep_opts, str(empty))
    expected = osp.join(str(empty), "dtd_prompt.json")
    with pytest.raises(FileNotFoundError, match=re.escape(f"expected file {expected} does not")):
        tr.train()
    # empty DESCRIPTIONS_DIR: the files are looked for next to the datasets
    tr = coprompt(tmp_path, dtd_root, deep_opts, "")
    expected = osp.join(dtd_root, "coprompt_descriptions", "dtd_prompt.json")
    with pytest.raises(FileNotFoundError, match=re.escape(expected) + ".*FALLBACK_TEMPLATES"):
        tr.train()


def test_fallback_templates_only_when_asked(tmp_path, dtd_root, deep_opts):
    empty = tmp_path / "empty"
    empty.mkdir()
    tr = coprompt(tmp_path, dtd_root, deep_opts, str(empty),
                  "TRAINER.COPROMPT.FALLBACK_TEMPLATES", "True")  # fmt: skip
    tr.train()
    texts = [f"{c} texture." for c in DTD_CLASSES]  # CoOp's DescribableTextures template
    assert class_descriptions(tr.cfg, DTD_CLASSES) == [[t] for t in texts]
    want = encode_texts(tr.model.text_encoder, texts).unsqueeze(1)  # [n_cls, 1, dim]
    assert torch.allclose(tr.model.description_features, want, atol=1e-6)


def test_description_file_class_matching(tmp_path):
    table = {
        "Blue Square": ["s1", "s2", "s3"],
        "red circle": ["r1", "r2"],
        "green": ["g1", "g2", "g3"],
    }
    path = tmp_path / "x_prompt.json"
    path.write_text(json.dumps(table))
    # "_" reads as " ", case-insensitive; unequal counts are cut to the smallest
    got = read_descriptions(str(path), ["blue_square", "red circle"])
    assert got == [["s1", "s2"], ["r1", "r2"]]
    with pytest.raises(ValueError, match="no descriptions for 2 of 3 classes: 'pink', 'teal'"):
        read_descriptions(str(path), ["pink", "green", "teal"])


@pytest.mark.skipif(
    not osp.isfile(osp.join(SHARED_DESCRIPTIONS, "dtd_prompt.json")),
    reason="CoPrompt's description files are not available here",
)
def test_real_description_file_for_dtd(tmp_path):
    cfg = make_cfg(["TRAINER.COPROMPT.DESCRIPTIONS_DIR", SHARED_DESCRIPTIONS], trainer="CoPrompt")
    texts = class_descriptions(cfg, DTD_CLASSES)
    assert len(texts) == len(DTD_CLASSES) and {len(t) for t in texts} == {50}
    assert tokenize([s for t in texts for s in t]).shape == (len(DTD_CLASSES) * 50, 77)


# ----------------------------------------------------------------------------------------------
# Configs, optimizers, precision, staged training
# ----------------------------------------------------------------------------------------------
PER_DATASET = {  # CoPrompt's published values: PROMPT_DEPTH, N_CTX, W, epochs
    "imagenet": (12, 4, 8.0, 8),
    "caltech101": (12, 4, 4.0, 8),
    "oxford_pets": (12, 2, 0.1, 8),
    "stanford_cars": (12, 4, 4.0, 8),
    "oxford_flowers": (9, 4, 8.0, 8),
    "food101": (9, 4, 0.5, 5),
    "fgvc_aircraft": (9, 4, 2.0, 8),
    "sun397": (12, 4, 8.0, 8),
    "dtd": (12, 2, 8.0, 8),
    "eurosat": (12, 2, 0.1, 8),
    "ucf101": (12, 4, 2.0, 8),
}


def test_configs_hold_the_published_values():
    main = make_cfg(["--config-file", osp.join(ROOT, MAIN_CFG)], trainer="CoPrompt")
    c, o = main.TRAINER.COPROMPT, main.OPTIM
    assert (c.N_CTX, c.PROMPT_DEPTH, c.W, c.PREC, c.CTX_INIT) == (2, 9, 1.0, "fp16", "a photo of a")
    assert (c.IMAGE_ADAPTER_RATIO, c.TEXT_ADAPTER_RATIO, c.DISTILL_LOSS) == (0.1, 0.2, "cos")
    assert (o.NAME, o.LR, o.MAX_EPOCH, main.DATALOADER.TRAIN_X.BATCH_SIZE) == ("sgd", 0.0035, 8, 4)
    assert main.DATALOADER.K_TRANSFORMS == 2
    assert main.INPUT.TRANSFORMS == ("randaugment", "normalize")
    overlays = glob.glob(osp.join(ROOT, "configs/trainers/CoPrompt/per_dataset/*.yaml"))
    assert {osp.basename(p)[:-5] for p in overlays} == set(PER_DATASET)
    for stem, values in PER_DATASET.items():
        overlay = osp.join(ROOT, f"configs/trainers/CoPrompt/per_dataset/{stem}.yaml")
        assert osp.isfile(osp.join(ROOT, f"configs/datasets/{stem}.yaml")), stem
        cfg = make_cfg(["--config-file", osp.join(ROOT, MAIN_CFG), overlay, "--seed", "1",
                        "TRAINER.COPROMPT.W", "0.3"], trainer="CoPrompt")  # fmt: skip
        c = cfg.TRAINER.COPROMPT
        assert (c.PROMPT_DEPTH, c.N_CTX, cfg.OPTIM.MAX_EPOCH) == (values[0], values[1], values[3])
        assert c.W == 0.3  # the command line still wins
        cfg = make_cfg(["--config-file", osp.join(ROOT, MAIN_CFG), overlay], trainer="CoPrompt")
        assert cfg.TRAINER.COPROMPT.W == values[2]


def test_optim_configs_hold_the_paper_values_and_freeze_projections_and_adapters():
    paper = {"sam": (0.05,), "sagm": (0.05, 0.001), "fsam": (0.05, 0.15),
             "sample": (0.05, 0.0015, 0.15)}  # fmt: skip
    for name, values in paper.items():
        path = osp.join(ROOT, f"configs/optim/CoPrompt/{name}.yaml")
        sam = make_cfg(["--optim-config-file", path], trainer="CoPrompt").OPTIM.SAM
        got = {"sam": (sam.RHO,), "sagm": (sam.RHO, sam.ALPHA), "fsam": (sam.RHO, sam.LAMBDA),
               "sample": (sam.RHO, sam.ALPHA, sam.LAMBDA)}[name]  # fmt: skip
        assert sam.NAME == name and got == values and sam.START_EPOCH == 0
        frozen = {n for n in LEARNABLE if any(fnmatch.fnmatch(n, p) for p in sam.FREEZE)}
        if name == "sample":  # staged (stage 2 after the published schedule): SAMPLe only
            assert sam.STAGE2_EPOCHS == 2
            assert frozen == {f"prompt_learner.{n}" for n in PROJECTIONS} | ADAPTERS
        else:
            assert sam.STAGE2_EPOCHS == 0 and not frozen


def test_bad_settings_are_errors(tmp_path, dtd_root, deep_opts, desc_dir):
    with pytest.raises(ValueError, match="set DATALOADER.K_TRANSFORMS 2"):
        coprompt(tmp_path, dtd_root, deep_opts, desc_dir, "DATALOADER.K_TRANSFORMS", "1")
    with pytest.raises(ValueError, match="DISTILL_LOSS must be one of"):
        coprompt(tmp_path, dtd_root, deep_opts, desc_dir, "TRAINER.COPROMPT.DISTILL_LOSS", "l1")


def test_staged_training_freezes_projections_and_adapters(tmp_path, dtd_root, deep_opts, desc_dir):
    tr = coprompt(tmp_path, dtd_root, deep_opts, desc_dir,
                  "OPTIM.MAX_EPOCH", "1", "OPTIM.SAM.STAGE2_EPOCHS", "1",
                  optim_file="configs/optim/CoPrompt/sample.yaml")  # fmt: skip
    frozen = {f"prompt_learner.{n}" for n in PROJECTIONS} | ADAPTERS
    check_staged(tr, staged_run(tr), frozen=frozen, trained=LEARNABLE - frozen)


@pytest.mark.slow
def test_train_py_base_to_new(tmp_path, dtd_root, deep_opts, desc_dir):
    # main config + the DTD overlay; its PROMPT_DEPTH 12 is overridden for the 4-block CLIP
    configs = [MAIN_CFG, "configs/trainers/CoPrompt/per_dataset/dtd.yaml"]
    check_base_to_new(tmp_path, dtd_root, deep_opts, "CoPrompt", configs, LEARNABLE,
                      "TRAINER.COPROMPT.DESCRIPTIONS_DIR", desc_dir)  # fmt: skip
