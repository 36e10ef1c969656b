"""A dataset from a folder, no code (``DATASET.NAME Folder``, datasets/folder.py): class folders in
mixed formats and lists, classnames.txt, the template, the saved split, the few-shot check,
tools/check_data.py, the grid's ``folder:NAME`` and a reader in a plugin file."""

from __future__ import annotations

import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
from conftest import ROOT, make_cfg

from datasets.folder import inspect_folder
from datasets.synthetic import FOLDER_FORMATS, make_folder_dataset, make_image_folder
from engine.data import build_dataset
from engine.errors import ConfigError, DataError
from experiments import grid_plan, protocols
from experiments.protocols import ProtocolError, Setup
from experiments.results import read_run
from tools import check_data, grid, make_tables

FOLDER_CFG = "configs/datasets/folder.yaml"
NAMES = ["great white shark", "red panda", "tabby cat", "tree frog"]  # red_panda: "_" -> " "


def folder_cfg(root, *opts, seed="1", folder="mydata", trainer="CoOp"):
    args = ["--root", root, "--seed", seed, *opts, "DATASET.FOLDER", folder]
    return make_cfg(args, trainer=trainer, dataset_cfg=FOLDER_CFG)


def counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in items:
        out[d.classname] = out.get(d.classname, 0) + 1
    return out


def test_class_folders_in_mixed_formats_split_saved_and_reused(tmp_path, caplog):
    root = str(tmp_path)
    data = make_folder_dataset(root)  # 4 classes x 14 images, 7 formats, half in more/
    with open(osp.join(data, "images", "tabby cat", "notes.txt"), "w") as f:
        f.write("not an image")
    ds = build_dataset(folder_cfg(root))
    assert ds.classnames == NAMES
    # CoOp's 50/20/30 per class: 14 -> 7/3/4; every format and nested image is read
    assert counts(ds.train_x) == dict.fromkeys(NAMES, 7)
    assert counts(ds.val) == dict.fromkeys(NAMES, 3) and counts(ds.test) == dict.fromkeys(NAMES, 4)
    paths = {d.impath for d in ds.train_x + ds.val + ds.test}
    assert len(paths) == 56 and {osp.splitext(p)[1] for p in paths} == set(FOLDER_FORMATS)
    assert any("/more/" in p for p in paths) and not any(p.endswith(".txt") for p in paths)

    # saved in CoOp's split_zhou format, relative to the dataset folder, and reused
    split_path = osp.join(data, "split_zhou_mydata.json")
    with open(split_path) as f:
        split = json.load(f)
    assert sorted(split) == ["test", "train", "val"]
    rel, label, name = split["train"][0]
    assert not osp.isabs(rel) and rel.startswith("images/") and NAMES[label] == name
    assert osp.join(data, rel) in paths
    before = os.stat(split_path).st_mtime_ns
    again = build_dataset(folder_cfg(root, seed="2"))  # another seed: the saved split
    assert [d.impath for d in again.test] == [d.impath for d in ds.test]
    assert os.stat(split_path).st_mtime_ns == before

    # 4 shots, base/new halves: first ceil(4/2) classes vs the rest, relabelled
    base = build_dataset(
        folder_cfg(root, "DATASET.NUM_SHOTS", "4", "DATASET.SUBSAMPLE_CLASSES", "base")
    )
    new = build_dataset(
        folder_cfg(root, "DATASET.NUM_SHOTS", "4", "DATASET.SUBSAMPLE_CLASSES", "new")
    )
    assert base.classnames == NAMES[:2] and new.classnames == NAMES[2:]
    assert counts(base.train_x) == dict.fromkeys(NAMES[:2], 4)
    assert {d.label for d in new.test} == {0, 1}
    assert os.listdir(osp.join(data, "split_fewshot"))  # the few-shot cache

    make_image_folder(osp.join(data, "images"), ["tree frog"], per_class=1, seed=5)  # added later
    build_dataset(folder_cfg(root))
    assert "1 image(s) in images/ are not in the split file" in caplog.text


def test_read_only_folder_keeps_its_split_in_the_user_cache(tmp_path, monkeypatch):
    from engine.data import cache_files

    root = str(tmp_path / "data")
    data = make_folder_dataset(root, per_class=5)
    real_access = os.access

    def access(path, mode, **kw):  # a read-only mount, even for root
        if mode & os.W_OK and osp.abspath(path).startswith(data):
            return False
        return real_access(path, mode, **kw)

    monkeypatch.setenv("SAMPLE_PL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache_files.os, "access", access)
    monkeypatch.setattr(cache_files, "_announced", set())
    first = build_dataset(folder_cfg(root, "DATASET.NUM_SHOTS", "2"))
    assert sorted(os.listdir(data)) == ["images"]  # nothing written next to the images
    saved = tmp_path / "cache" / "datasets" / data.lstrip(os.sep) / "split_zhou_mydata.json"
    assert saved.is_file()
    again = build_dataset(folder_cfg(root, "DATASET.NUM_SHOTS", "2", seed="3"))
    assert again.test == first.test
    with pytest.raises(DataError, match=f"delete {saved} so that"):
        build_dataset(folder_cfg(root, "DATASET.NUM_SHOTS", "3"))


def test_too_few_images_for_the_shots_is_a_clear_error(tmp_path, capsys, tiny_clip_opts):
    from engine.runner import run_in_process

    root = str(tmp_path)
    make_folder_dataset(root, classes=["rare_bird"], per_class=6, seed=1, folder="few")
    make_folder_dataset(root, classes=["common bird"], per_class=40, folder="few")
    with pytest.raises(DataError) as e:
        build_dataset(folder_cfg(root, "DATASET.NUM_SHOTS", "16", folder="few"))
    msg = str(e.value)
    assert "folder:few: DATASET.NUM_SHOTS 16 needs 16 training images per class" in msg
    assert "class 'rare bird' has 3 training image(s) of 6" in msg
    assert "lower DATASET.NUM_SHOTS to 3" in msg and "split_zhou_few.json" in msg
    assert "common bird" not in msg
    # train.py: one paragraph and exit status 2, no traceback
    argv = [
        "--root",
        root,
        "--trainer",
        "CoOp",
        "--dataset-config-file",
        osp.join(ROOT, FOLDER_CFG),
    ]
    argv += ["--output-dir", str(tmp_path / "run"), *tiny_clip_opts, "DATASET.FOLDER", "few"]
    assert run_in_process([*argv, "DATASET.NUM_SHOTS", "16"]) == 2
    err = capsys.readouterr().err
    assert "Error: folder:few: DATASET.NUM_SHOTS 16" in err and "Traceback" not in err
    # fewer than 4 images: too few for the 50/20/30 split, named
    make_folder_dataset(root, classes=["tiny"], per_class=3, folder="tiny3")
    make_folder_dataset(root, classes=["big"], per_class=8, folder="tiny3")
    with pytest.raises(DataError, match=r"Class 'tiny' in .*tiny3/images/tiny has 3 images"):
        build_dataset(folder_cfg(root, folder="tiny3"))
    with pytest.raises(ConfigError, match="DATASET.FOLDER is empty"):
        build_dataset(make_cfg(["--root", root], dataset_cfg=FOLDER_CFG))


def test_classnames_file_orders_and_names_the_classes(tmp_path):
    root = str(tmp_path)
    data = make_folder_dataset(root, per_class=5)
    with open(osp.join(data, "classnames.txt"), "w") as f:
        f.write("tree frog\ttree frog (Hylidae)\nred_panda lesser panda\n\ntabby cat\n")
        f.write("great white shark\n")
    ds = build_dataset(folder_cfg(root))
    assert ds.classnames == [
        "tree frog (Hylidae)",
        "lesser panda",
        "tabby cat",
        "great white shark",
    ]
    assert all("tree frog/" in d.impath for d in ds.train_x if d.label == 0)
    os.remove(osp.join(data, "split_zhou_mydata.json"))
    with open(osp.join(data, "classnames.txt"), "a") as f:
        f.write("zebra a zebra\n")
    with pytest.raises(DataError, match=r"classnames.txt:6: 'zebra' is not a class folder"):
        build_dataset(folder_cfg(root))


def _write_lists(data: str, rows: dict[str, list], fmt: str) -> None:
    for split, items in rows.items():
        path = osp.join(data, f"{split}.{fmt}")
        with open(path, "w") as f:
            if fmt == "json":
                json.dump([{"path": p, "label": y} if i % 2 else [p, y] for i, (p, y) in
                           enumerate(items)], f)  # fmt: skip
            else:
                f.write("path,label\n" + "".join(f"{p},{y}\n" for p, y in items))


def test_csv_and_json_lists(tmp_path):
    root = str(tmp_path)
    data = make_folder_dataset(root, folder="listed", per_class=10)
    images = {
        c: sorted(os.listdir(osp.join(data, "images", c)))
        for c in os.listdir(osp.join(data, "images"))
    }
    rows = {"train": [], "test": []}
    for c, files in sorted(images.items()):
        files = [f for f in files if f != "more"]  # top-level images of each class: 5
        rows["train"] += [(f"images/{c}/{f}", c) for f in files[:4]]
        rows["test"] += [(f"images/{c}/{f}", c) for f in files[4:]]
    # train + test CSV: 20% of each class of the train list becomes val, saved in the split file
    _write_lists(data, rows, "csv")
    ds = build_dataset(folder_cfg(root, folder="listed"))
    assert ds.classnames == NAMES
    assert counts(ds.train_x) == dict.fromkeys(NAMES, 3) and counts(ds.val) == dict.fromkeys(
        NAMES, 1
    )
    assert counts(ds.test) == dict.fromkeys(NAMES, 1)
    assert osp.isfile(osp.join(data, "split_zhou_listed.json"))
    for split in rows:
        os.remove(osp.join(data, f"{split}.csv"))
    os.remove(osp.join(data, "split_zhou_listed.json"))

    # train/val/test JSON with numeric labels and classnames.txt: the lists are the split
    order = sorted(images)
    numeric = {s: [(p, order.index(c)) for p, c in items] for s, items in rows.items()}
    numeric["val"] = numeric["train"][:1]
    numeric["train"] = numeric["train"][1:]
    _write_lists(data, numeric, "json")
    with pytest.raises(DataError, match="labels of .* are numbers"):
        build_dataset(folder_cfg(root, folder="listed"))
    with open(osp.join(data, "classnames.txt"), "w") as f:
        f.write("".join(f"{i} {c.replace('_', ' ')}\n" for i, c in enumerate(order)))
    ds = build_dataset(folder_cfg(root, folder="listed"))
    assert ds.classnames == NAMES and len(ds.val) == 1 and len(ds.train_x) == 15
    assert not osp.isfile(osp.join(data, "split_zhou_listed.json"))
    with open(osp.join(data, "test.json"), "w") as f:
        json.dump([["images/x.jpg", 0, "extra"]], f)
    with pytest.raises(DataError, match=r"test.json: item 0: expected \[path, label\]"):
        build_dataset(folder_cfg(root, folder="listed"))
    os.remove(osp.join(data, "test.json"))
    with pytest.raises(DataError, match=r"found but no test.csv / test.json: give train and test"):
        build_dataset(folder_cfg(root, folder="listed"))


def test_template_reaches_the_trainers_lookups(tmp_path):
    from trainers.kgcoop import kgcoop_template
    from trainers.tcp import tcp_templates
    from trainers.zsclip import dataset_template

    cfg = folder_cfg(str(tmp_path), "DATASET.TEMPLATE", "a photo of a {}, a type of bird.")
    d = cfg.DATASET
    assert dataset_template(d.NAME, d.TEMPLATE) == "a photo of a {}, a type of bird."
    assert kgcoop_template(d.NAME, d.TEMPLATE) == "a photo of a {}, a type of bird."
    assert tcp_templates(d.NAME, d.TEMPLATE) == (d.TEMPLATE, d.TEMPLATE)
    assert tcp_templates("X", "{} texture.") == ("X X X X {} texture.", "{} texture.")
    from trainers.coprompt import description_file

    assert description_file(cfg).endswith("/mydata_prompt.json")  # CoPrompt: the folder's name
    default = folder_cfg(str(tmp_path)).DATASET
    assert dataset_template(default.NAME, default.TEMPLATE) == "a photo of a {}."
    assert dataset_template("EuroSAT", "") == "a centered satellite photo of {}."
    from engine.data.validate import validate_data_cfg

    for bad in ("a photo of a bird.", "{} and {}", "a {} of {size}"):
        with pytest.raises(ConfigError, match="DATASET.TEMPLATE must be empty or a text"):
            validate_data_cfg(folder_cfg(str(tmp_path), "DATASET.TEMPLATE", bad))


def test_zero_shot_clip_prompts_with_the_template(tmp_path, tiny_clip_opts):
    from engine import build_trainer

    root = str(tmp_path)
    make_folder_dataset(root, per_class=5)
    opts = ["--output-dir", str(tmp_path / "zs"), *tiny_clip_opts]
    cfg = folder_cfg(
        root, *opts, "DATASET.TEMPLATE", "a blurry photo of a {}.", trainer="ZeroshotCLIP"
    )
    trainer = build_trainer(cfg)
    assert trainer.templates() == ["a blurry photo of a {}."]
    assert trainer.classnames == NAMES


def test_check_data_on_folder_datasets(tmp_path, capsys):
    root = str(tmp_path)
    make_folder_dataset(root, per_class=8)
    make_folder_dataset(root, classes=["few"], per_class=3, folder="short")
    # 8 images per class: about 4 training images after CoOp's split, too few for 16 shots
    assert check_data.main(["--root", root, "folder:mydata"]) == 1
    out = capsys.readouterr().out
    assert "too small" in out and "0 of 1 ready" in out and " ready " not in out
    status, details = check_data.check_dataset(root, "folder:mydata")
    assert status == "too small"
    assert "too few training images for 16 shots in every class" in details[0]
    assert "run with 4 shots or fewer (SHOTS=4 for the scripts" in details[0]
    assert check_data.main(["--root", root, "--shots", "4", "folder:mydata"]) == 0
    out = capsys.readouterr().out
    assert "folder:mydata" in out and "ready" in out and "4 classes, 32 images" in out
    assert "no split_zhou_mydata.json yet" in out and "1 of 1 ready" in out
    problems, notes = inspect_folder(root, "mydata")
    assert not problems
    assert check_data.main(["--root", root, "folder:short", "folder:absent"]) == 1
    out = capsys.readouterr().out
    assert "partial" in out and "'few' (3) have fewer than 4 images" in out
    assert "absent/ not found" in out and "DATASET.ROOT/absent/images/<class>/" in out
    with pytest.raises(SystemExit):
        check_data.main(["--root", root, "Folder"])
    assert "check it as folder:<that folder>" in capsys.readouterr().err


def test_the_dry_run_warns_when_the_classes_are_too_small_for_the_shots(tmp_path, capsys):
    root = str(tmp_path / "data")
    make_folder_dataset(root, per_class=8)
    argv = ["--trainers", "CoOp", "--optims", "sgd", "--datasets", "folder:mydata", "--seeds", "1"]
    argv += ["--data", root, "--output", str(tmp_path / "out"), "--dry-run"]
    assert grid.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 to run" in out
    assert "warning: folder:mydata: too few training images for 16 shots in every class" in out
    assert grid.main([*argv, "--shots", "4"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_a_corrected_list_replaces_the_split_made_from_the_old_one(tmp_path, caplog):
    root = str(tmp_path)
    data = make_folder_dataset(root, folder="listed", per_class=10)
    rows = {"train": [], "test": []}
    for c in sorted(os.listdir(osp.join(data, "images"))):
        files = sorted(f for f in os.listdir(osp.join(data, "images", c)) if f != "more")
        rows["train"] += [(f"images/{c}/{f}", c) for f in files[:4]]
        rows["test"] += [(f"images/{c}/{f}", c) for f in files[4:]]
    good = list(rows["test"])
    rows["test"][0] = ("images/red_panda/typo.jpg", rows["test"][0][1])  # a missing file
    _write_lists(data, rows, "csv")
    with pytest.raises(DataError, match="typo.jpg"):
        build_dataset(folder_cfg(root, folder="listed"))
    split = osp.join(data, "split_zhou_listed.json")
    assert osp.isfile(split)  # made from the broken lists
    rows["test"] = good
    _write_lists(data, rows, "csv")
    ds = build_dataset(folder_cfg(root, folder="listed"))  # the corrected lists are used
    assert len(ds.test) == len(good) and not any("typo" in d.impath for d in ds.test)
    assert "changed since" in caplog.text and split in caplog.text
    with open(split) as f:
        assert "typo.jpg" not in f.read()


@pytest.mark.parametrize("how", ["folders", "classnames"])
def test_two_classes_with_one_name_are_refused_naming_both(tmp_path, capsys, how):
    root = str(tmp_path)
    if how == "folders":  # "red_panda" reads as "red panda"
        data = make_folder_dataset(root, classes=["red_panda", "red panda", "cat"], per_class=8)
        match = r"Classes 'red panda' and 'red_panda' have the same name 'red panda'"
    else:
        data = make_folder_dataset(root, classes=["a", "b", "c"], per_class=8)
        with open(osp.join(data, "classnames.txt"), "w") as f:
            f.write("a\tcat\nb\tdog\nc\tCat\n")
        match = r"Classes 'a' and 'c' have the same name 'Cat' in .*classnames.txt"
    with pytest.raises(DataError, match=match):
        build_dataset(folder_cfg(root))
    assert check_data.main(["--root", root, "--shots", "2", "folder:mydata"]) == 1
    assert "the same name" in capsys.readouterr().out


def test_grid_names_folder_datasets(tmp_path):
    setup = Setup(data="DATA", output=str(tmp_path), shots=4, plugins=("/abs/reader.py",))
    grids = grid_plan.select(None, trainers=["CoOp"], optims=["sgd"], seeds=[1],
                        protocols=["base2new", "cross_dataset"], datasets=["folder:birds"],
                        xd_targets=["folder:birds"])  # fmt: skip
    b2n, xd = grid_plan.expand(grids, setup)
    train, test = b2n.runs
    assert train.out_dir == str(
        tmp_path / "base2new/train_base/birds/shots_4/CoOp/vit_b16_ctxv1/seed1"
    )
    cmd = train.command(setup)
    assert cmd[cmd.index("--dataset-config-file") + 1].endswith("configs/datasets/folder.yaml")
    assert cmd[cmd.index("--plugin") + 1] == "/abs/reader.py"
    assert "DATASET.FOLDER birds DATALOADER.TRAIN_X.DROP_LAST True" in " ".join(cmd)
    target = xd.evals[0]
    assert target.out_dir.endswith("evaluation/CoOp/vit_b16_ep50_ctxv1_4shots/birds/seed1")
    assert "DATASET.FOLDER birds" in " ".join(target.command(setup, 3))
    assert "DATASET.FOLDER" not in " ".join(xd.train.command(setup))  # ImageNet training
    for bad, msg in (("folder:dtd", "built-in dataset's name"), ("folder:a b", "letters, digits")):
        with pytest.raises(ProtocolError, match=msg):
            grid_plan.expand(grid_plan.select(None, trainers=["CoOp"], datasets=[bad]), setup)
    args = grid.build_parser().parse_args(
        ["--trainers", "CoOp", "--plugin", "r.py", "--plugin", "m.x"]
    )
    assert grid.setup_from_args(args).plugins == (osp.abspath("r.py"), "m.x")

    # a dataset config file of one's own (e.g. naming a plugin's reader)
    own = tmp_path / "cfgs" / "my_animals.yaml"
    own.parent.mkdir()
    own.write_text("DATASET:\n  NAME: MyAnimals\n")
    grids = grid_plan.select(None, trainers=["CoOp"], datasets=[str(own)], seeds=[1])
    (chain,) = grid_plan.expand(grids, setup)
    cmd = chain.train.command(setup)
    assert cmd[cmd.index("--dataset-config-file") + 1] == str(own)
    assert "/train_base/my_animals/shots_4/" in chain.train.out_dir
    assert protocols.dataset_registry_name(str(own)) == "MyAnimals"
    own.write_text("DATASET:\n  NAME: Folder\n  FOLDER: birds\n")
    assert protocols.dataset_registry_name(str(own)) == "folder:birds"
    with pytest.raises(ProtocolError, match="built-in dataset's name"):
        protocols.dataset_dir(str(tmp_path / "dtd.yaml"))


READER = '''
from datasets.common import CoOpDataset, Layout
from engine.data import Datum, read_and_split_data
from engine.registry import DATASET_REGISTRY

LAYOUT = Layout(
    name="Shout",
    folder="shout",
    required=("images/",),
    split_file="split_zhou_Shout.json",
    class_dirs=("images",),
    num_classes=2,
    how="images/<class>/*.jpg",
)


@DATASET_REGISTRY.register()
class Shout(CoOpDataset):
    """A user's reader: class folders, class names in capitals."""

    layout = LAYOUT
    image_subdir = "images"

    def generate_split(self, rng):
        splits = read_and_split_data(self.image_dir, rng=rng)
        return [[Datum(d.impath, d.label, 0, d.classname.upper()) for d in s] for s in splits]
'''


def test_a_reader_in_a_plugin_file(tmp_path, monkeypatch, capsys):
    """--plugin: train.py's config and dataset, and tools/check_data.py, in this process with the
    registry, the plugin cache and sys.path restored afterwards."""
    from engine import plugins
    from engine.cli import build_parser, setup_cfg
    from engine.registry import DATASET_REGISTRY

    monkeypatch.setattr(DATASET_REGISTRY, "_obj_map", dict(DATASET_REGISTRY._obj_map))
    monkeypatch.setattr(plugins, "_loaded", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("SAMPLE_PL_PLUGINS", raising=False)
    root = str(tmp_path / "data")
    make_image_folder(osp.join(root, "shout", "images"), ["sea lion", "barn_owl"], per_class=4)
    reader = tmp_path / "my_reader_23a.py"
    reader.write_text(READER)
    argv = ["--plugin", str(reader), "--root", root, "--trainer", "CoOp", "DATASET.NAME", "Shout"]
    cfg = setup_cfg(build_parser().parse_args(argv))
    assert build_dataset(cfg).classnames == ["BARN_OWL", "SEA LION"]
    assert list(cfg.PLUGINS) == [str(reader)]
    assert check_data.main(["--plugin", str(reader), "--root", root, "Shout"]) == 0
    assert "1 of 1 ready" in capsys.readouterr().out
    monkeypatch.setattr(DATASET_REGISTRY, "_obj_map", dict(DATASET_REGISTRY._obj_map))
    DATASET_REGISTRY._obj_map.pop("Shout")
    with pytest.raises(SystemExit):  # without the plugin: an unknown dataset
        check_data.main(["--root", root, "Shout"])
    assert "Unknown dataset 'Shout'" in capsys.readouterr().err


def test_the_grid_checks_folder_datasets_with_its_plugins(monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "checked", "")

    monkeypatch.setattr(protocols.subprocess, "run", fake_run)
    assert protocols.check_data("DATA", ["folder:birds", "dtd"], ("/abs/r.py",)) is None
    assert seen[0][2:] == [
        "--root",
        "DATA",
        "--plugin=/abs/r.py",
        "--shots=16",
        "folder:birds",
        "DescribableTextures",
    ]


@pytest.mark.slow
def test_one_command_base_to_new_then_cross_dataset_target(tmp_path, tiny_clip_opts):
    """``REPORT=... bash scripts/base2new.sh folder:birds``: base classes trained, new classes
    evaluated, the tables and the HTML report (the one command of docs/own-dataset.md); then
    the grid trains on ImageNet and evaluates on the folder dataset as a cross-dataset target."""
    data, out, report = tmp_path / "data", tmp_path / "output", tmp_path / "report"
    make_folder_dataset(str(data), folder="birds", per_class=8)
    plugin = tmp_path / "noop_plugin.py"
    plugin.write_text("LOADED = True\n")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env.update(DATA=str(data), OUTPUT=str(out), OPTIM="sgd", SEEDS="1", SHOTS="2")
    env.update(REPRO="paper", REPORT=str(report))
    opts = [*tiny_clip_opts, "TRAINER.COOP.PREC", "fp32", "OPTIM.MAX_EPOCH", "1"]
    flags = ["--in-process", "--quiet", "--no-check", f"--plugin={plugin}"]
    script = ["bash", osp.join(ROOT, "scripts", "base2new.sh"), *flags, "folder:birds", *opts]
    proc = subprocess.run(script, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "All runs finished." in proc.stdout and "Base-to-new: birds" in proc.stdout
    b2n = osp.join(str(out), "base2new", "{}", "birds", "shots_2", "CoOp", "vit_b16_ctxv1", "seed1")
    base, new = (read_run(b2n.format(s)) for s in ("train_base", "test_new"))
    assert base.status == "done" and new.status == "done"
    with open(osp.join(b2n.format("test_new"), "log.txt")) as f:
        assert re.search(r"# classes\s+2\n", f.read())  # 4 classes: 2 new
    with open(osp.join(b2n.format("train_base"), "config.yaml")) as f:
        config = f.read()
    assert "FOLDER: birds" in config and str(plugin) in config
    assert osp.isfile(data / "birds" / "split_zhou_birds.json")
    assert "birds" in (report / "index.html").read_text()

    wnids = ["n01440764", "n01443537"]
    make_image_folder(str(data / "imagenet" / "images" / "train"), wnids, per_class=3, seed=1)
    make_image_folder(str(data / "imagenet" / "images" / "val"), wnids, per_class=2, seed=2)
    (data / "imagenet" / "classnames.txt").write_text("n01440764 tench\nn01443537 goldfish\n")
    axes = ["--trainers", "CoOp", "--optims", "sgd", "--seeds", "1", "--shots", "2"]
    axes += ["--output", str(out), "--repro", "paper", "--protocols", "cross_dataset"]
    axes += ["--xd-targets", "folder:birds"]
    argv = [*axes, "--data", str(data), "--in-process", "--quiet", "--no-check"]
    cmd = [sys.executable, osp.join(ROOT, "tools", "grid.py"), *argv, "--", *opts]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    xd = out / "evaluation" / "CoOp" / "vit_b16_ep50_ctxv1_2shots" / "birds" / "seed1"
    target = read_run(str(xd), "eval")
    assert target.status == "done"
    (table,) = make_tables.build_tables(make_tables.build_parser().parse_args(axes))
    assert table.headers == ["Method", "ImageNet", "birds", "Avg"]
    assert table.rows[0][2].value == target.accuracy
    (panel,) = make_tables.build_tables(
        make_tables.build_parser().parse_args([*axes[:-4], "--datasets", "folder:birds"])
    )
    assert panel.title == "Base-to-new: birds"
    assert [c.value for c in panel.rows[0][1:3]] == [base.accuracy, new.accuracy]
