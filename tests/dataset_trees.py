"""Miniature copies of the 15 datasets in their exact CoOp layouts, for the reader tests.

Each builder writes tiny JPEGs and the dataset's own metadata files in their real formats
(text lists, JSON, MATLAB .mat files written with scipy) under ``root`` and returns what the
reader should produce: class names by label and the (train, val, test) sizes.
"""

from __future__ import annotations

import io
import json
import os
import os.path as osp
import pickle
import sys
import types
from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy.io import savemat

from datasets import synthetic

# each reader's dataset config (configs/datasets/<stem>.yaml)
CONFIGS = {
    "ImageNet": "imagenet",
    "Caltech101": "caltech101",
    "OxfordPets": "oxford_pets",
    "StanfordCars": "stanford_cars",
    "OxfordFlowers": "oxford_flowers",
    "Food101": "food101",
    "FGVCAircraft": "fgvc_aircraft",
    "SUN397": "sun397",
    "DescribableTextures": "dtd",
    "EuroSAT": "eurosat",
    "UCF101": "ucf101",
    "ImageNetV2": "imagenetv2",
    "ImageNetSketch": "imagenet_sketch",
    "ImageNetA": "imagenet_a",
    "ImageNetR": "imagenet_r",
}


@dataclass
class Expected:
    names: list[str]  # class names by label
    sizes: tuple[int, int, int]  # train, val, test (val = test for ImageNet; eval-only: 0, 0, n)


def _jpeg(label: int) -> bytes:
    img = Image.new("RGB", (8, 8), ((label * 40) % 256, (label * 90) % 256, 128))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


def write_images(paths: list[str], label: int = 0) -> None:
    data = _jpeg(label)
    for path in paths:
        os.makedirs(osp.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def write_text(path: str, lines: list[str], newline: str = "\n") -> None:
    os.makedirs(osp.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write("".join(line + newline for line in lines))


def _class_folders(image_dir: str, folders: list[str], per_class: int, ext: str = ".jpg"):
    for label, folder in enumerate(folders):
        paths = [osp.join(image_dir, folder, f"{folder}_{i}{ext}") for i in range(per_class)]
        write_images(paths, label)


# ----------------------------------------------------------------------------------------------
# Datasets split by CoOp from class folders (50/20/30 per class)
# ----------------------------------------------------------------------------------------------
def make_caltech101(root: str) -> Expected:
    folders = ["BACKGROUND_Google", "Faces", "Faces_easy", "Leopards", "Motorbikes"]
    folders += ["accordion", "airplanes", "anchor"]
    _class_folders(osp.join(root, "caltech-101", "101_ObjectCategories"), folders, 10)
    names = ["face", "leopard", "motorbike", "accordion", "airplane", "anchor"]
    return Expected(names, (30, 12, 18))


def make_dtd(root: str) -> Expected:
    names = ["banded", "blotchy", "braided", "bubbly"]
    synthetic.make_dtd(root, names, per_class=10)  # the generator the other tests use
    return Expected(names, (20, 8, 12))


def make_food101(root: str) -> Expected:
    names = ["apple_pie", "baby_back_ribs", "baklava", "beef_carpaccio"]
    _class_folders(osp.join(root, "food-101", "images"), names, 10)
    return Expected(names, (20, 8, 12))


EUROSAT_NAMES = {
    "AnnualCrop": "Annual Crop Land",
    "Forest": "Forest",
    "HerbaceousVegetation": "Herbaceous Vegetation Land",
    "Highway": "Highway or Road",
    "Industrial": "Industrial Buildings",
    "Pasture": "Pasture Land",
    "PermanentCrop": "Permanent Crop Land",
    "Residential": "Residential Buildings",
    "River": "River",
    "SeaLake": "Sea or Lake",
}


def make_eurosat(root: str) -> Expected:
    folders = sorted(EUROSAT_NAMES)
    _class_folders(osp.join(root, "eurosat", "2750"), folders, 5)  # 5 -> 2/1/2
    return Expected([EUROSAT_NAMES[f] for f in folders], (20, 10, 20))


# ----------------------------------------------------------------------------------------------
# Datasets with annotation files
# ----------------------------------------------------------------------------------------------
def make_oxford_pets(root: str) -> Expected:
    d = osp.join(root, "oxford_pets")
    breeds = ["Abyssinian", "american_bulldog", "american_pit_bull_terrier", "Bengal"]
    trainval, test = [], []
    for label, breed in enumerate(breeds):
        species = 1 if breed[0].isupper() else 2  # cats are capitalised
        for i in range(8):
            imname = f"{breed}_{i + 1}"
            write_images([osp.join(d, "images", imname + ".jpg")], label)
            (trainval if i < 5 else test).append(f"{imname} {label + 1} {species} {i + 1}")
    write_text(osp.join(d, "annotations", "trainval.txt"), trainval)
    write_text(osp.join(d, "annotations", "test.txt"), test)
    names = ["abyssinian", "american_bulldog", "american_pit_bull_terrier", "bengal"]
    return Expected(names, (16, 4, 12))  # trainval 5 per class -> 4/1


CARS = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Acura TL Sedan 2012"]
CARS += ["Acura TL Type-S 2008"]


def _cars_annos(path: str, classes: list[int]) -> list[str]:
    fnames = [f"{i + 1:05d}.jpg" for i in range(len(classes))]
    annos = np.zeros((1, len(classes)), dtype=[("bbox_x1", "O"), ("class", "O"), ("fname", "O")])
    for i, (fname, cls) in enumerate(zip(fnames, classes)):
        annos[0, i] = (np.array([[10]], np.uint8), np.array([[cls]], np.uint8), np.array([fname]))
    savemat(path, {"annotations": annos})
    return fnames


def make_stanford_cars(root: str) -> Expected:
    d = osp.join(root, "stanford_cars")
    os.makedirs(osp.join(d, "devkit"))
    meta = np.empty((1, len(CARS)), dtype=object)
    for i, name in enumerate(CARS):
        meta[0, i] = np.array([name])
    savemat(osp.join(d, "devkit", "cars_meta.mat"), {"class_names": meta})
    train_cls = [i % 4 + 1 for i in range(20)]  # 1-based, interleaved
    test_cls = [i % 4 + 1 for i in range(12)]
    for sub, anno, cls in (
        ("cars_train", osp.join(d, "devkit", "cars_train_annos.mat"), train_cls),
        ("cars_test", osp.join(d, "cars_test_annos_withlabels.mat"), test_cls),
    ):
        fnames = _cars_annos(anno, cls)
        for fname, c in zip(fnames, cls):
            write_images([osp.join(d, sub, fname)], c)
    names = ["2000 AM General Hummer SUV", "2012 Acura RL Sedan", "2012 Acura TL Sedan"]
    return Expected(names + ["2008 Acura TL Type-S"], (16, 4, 12))


def make_oxford_flowers(root: str) -> Expected:
    d = osp.join(root, "oxford_flowers")
    cat_to_name = {"1": "pink primrose", "2": "hard-leaved pocket orchid"}
    cat_to_name |= {"3": "canterbury bells", "4": "sweet pea"}
    labels = [(3, 1, 2, 4)[i % 4] for i in range(40)]  # first appearance: 3, 1, 2, 4
    write_images([osp.join(d, "jpg", f"image_{i + 1:05d}.jpg") for i in range(40)])
    savemat(osp.join(d, "imagelabels.mat"), {"labels": np.array([labels], dtype=np.uint8)})
    with open(osp.join(d, "cat_to_name.json"), "w") as f:
        json.dump(cat_to_name, f)
    return Expected([cat_to_name[str(i)] for i in range(1, 5)], (20, 8, 12))


def make_fgvc_aircraft(root: str) -> Expected:
    d = osp.join(root, "fgvc_aircraft")
    variants = ["707-320", "A300B4", "F-16A/B", "Boeing 717"]  # file order, not sorted
    write_text(osp.join(d, "variants.txt"), variants)
    n = 0
    for split, per_class in (("train", 3), ("val", 2), ("test", 3)):
        lines = []
        for label, variant in enumerate(variants):
            for _ in range(per_class):
                n += 1
                write_images([osp.join(d, "images", f"{n:07d}.jpg")], label)
                lines.append(f"{n:07d} {variant}")
        write_text(osp.join(d, f"images_variant_{split}.txt"), lines)
    return Expected(variants, (12, 8, 12))


def make_sun397(root: str) -> Expected:
    d = osp.join(root, "sun397")
    cats = ["a/abbey", "a/apartment_building/outdoor", "b/bakery/shop", "b/bamboo_forest"]
    write_text(osp.join(d, "ClassName.txt"), ["/" + c for c in cats])
    train, test = [], []
    for label, cat in enumerate(cats):
        for i in range(8):
            rel = f"{cat}/sun_{label}{i:03d}.jpg"
            write_images([osp.join(d, "SUN397", rel)], label)
            (train if i < 5 else test).append("/" + rel)
    write_text(osp.join(d, "Training_01.txt"), train)
    write_text(osp.join(d, "Testing_01.txt"), test)
    names = ["abbey", "outdoor apartment_building", "shop bakery", "bamboo_forest"]
    return Expected(names, (16, 4, 12))


def make_ucf101(root: str) -> Expected:
    d = osp.join(root, "ucf101")
    actions = ["ApplyEyeMakeup", "ApplyLipstick", "Archery", "YoYo"]
    folders = ["Apply_Eye_Makeup", "Apply_Lipstick", "Archery", "Yo_Yo"]
    lists = osp.join(d, "ucfTrainTestlist")
    write_text(
        osp.join(lists, "classInd.txt"), [f"{i + 1} {a}" for i, a in enumerate(actions)], "\r\n"
    )
    train, test = [], []
    for label, (action, folder) in enumerate(zip(actions, folders)):
        for g in range(8):
            video = f"v_{action}_g{g + 8:02d}_c01"
            write_images([osp.join(d, "UCF-101-midframes", folder, video + ".jpg")], label)
            if g < 5:
                train.append(f"{action}/{video}.avi {label + 1}")
            else:
                test.append(f"{action}/{video}.avi")
    write_text(osp.join(lists, "trainlist01.txt"), train, "\r\n")
    write_text(osp.join(lists, "testlist01.txt"), test, "\r\n")
    return Expected(folders, (16, 4, 12))


# ----------------------------------------------------------------------------------------------
# ImageNet and its variants
# ----------------------------------------------------------------------------------------------
WNIDS = {  # file order of the tiny classnames.txt (not sorted: labels follow sorted wnids)
    "n01491361": "tiger shark",
    "n01440764": "tench",
    "n01484850": "great white shark",
    "n01443537": "goldfish",
    "n01494475": "hammerhead shark",
}


def write_classnames(path: str) -> None:
    write_text(path, [f"{w} {n}" for w, n in WNIDS.items()])


def make_imagenet(root: str) -> Expected:
    d = osp.join(root, "imagenet")
    write_classnames(osp.join(d, "classnames.txt"))
    wnids = sorted(WNIDS)
    for label, wnid in enumerate(wnids):
        train = [osp.join(d, "images", "train", wnid, f"{wnid}_{i}.JPEG") for i in range(4)]
        val = [
            osp.join(d, "images", "val", wnid, f"ILSVRC2012_val_{label}{i}.JPEG") for i in range(2)
        ]
        write_images(train + val, label)
    return Expected([WNIDS[w] for w in wnids], (20, 10, 10))


def make_imagenetv2(root: str) -> Expected:
    d = osp.join(root, "imagenetv2")
    write_classnames(osp.join(d, "classnames.txt"))
    for label in range(len(WNIDS)):
        class_dir = osp.join(d, "imagenetv2-matched-frequency-format-val", str(label))
        write_images([osp.join(class_dir, f"{label}abc{i}.jpeg") for i in range(3)], label)
    return Expected(list(WNIDS.values()), (0, 0, 15))


def _wnid_folders(d: str, image_subdir: str, wnids: list[str], per_class: int) -> None:
    write_classnames(osp.join(d, "classnames.txt"))
    _class_folders(osp.join(d, image_subdir), wnids, per_class)


def make_imagenet_sketch(root: str) -> Expected:
    wnids = sorted(WNIDS)[:4]
    _wnid_folders(osp.join(root, "imagenet-sketch"), "images", wnids, 3)
    return Expected([WNIDS[w] for w in wnids], (0, 0, 12))


def make_imagenet_a(root: str) -> Expected:
    wnids = ["n01443537", "n01484850", "n01494475"]
    d = osp.join(root, "imagenet-adversarial")
    _wnid_folders(d, "imagenet-a", wnids, 2)
    write_text(osp.join(d, "imagenet-a", "README.txt"), ["not a class"])
    return Expected([WNIDS[w] for w in wnids], (0, 0, 6))


def make_imagenet_r(root: str) -> Expected:
    wnids = ["n01440764", "n01443537", "n01491361"]
    d = osp.join(root, "imagenet-rendition")
    _wnid_folders(d, "imagenet-r", wnids, 2)
    write_text(osp.join(d, "imagenet-r", "README.txt"), ["not a class"])
    return Expected([WNIDS[w] for w in wnids], (0, 0, 6))


BUILDERS = {
    "ImageNet": make_imagenet,
    "Caltech101": make_caltech101,
    "OxfordPets": make_oxford_pets,
    "StanfordCars": make_stanford_cars,
    "OxfordFlowers": make_oxford_flowers,
    "Food101": make_food101,
    "FGVCAircraft": make_fgvc_aircraft,
    "SUN397": make_sun397,
    "DescribableTextures": make_dtd,
    "EuroSAT": make_eurosat,
    "UCF101": make_ucf101,
    "ImageNetV2": make_imagenetv2,
    "ImageNetSketch": make_imagenet_sketch,
    "ImageNetA": make_imagenet_a,
    "ImageNetR": make_imagenet_r,
}


def coop_pickle(obj_factory, path: str) -> None:
    """Pickle what ``obj_factory(Datum)`` returns, where Datum is a stand-in whose class path is
    Dassl's ``dassl.data.datasets.base_dataset.Datum`` (fields in ``__dict__``, as Dassl's)."""
    mod = types.ModuleType("dassl.data.datasets.base_dataset")

    class Datum:
        def __init__(self, impath, label, classname):
            self._impath, self._label, self._domain, self._classname = impath, label, 0, classname

    Datum.__module__ = mod.__name__
    Datum.__qualname__ = "Datum"
    mod.Datum = Datum
    names = ("dassl", "dassl.data", "dassl.data.datasets", mod.__name__)
    for name in names[:-1]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[mod.__name__] = mod
    try:
        with open(path, "wb") as f:
            pickle.dump(obj_factory(Datum), f, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for name in names:
            sys.modules.pop(name, None)
