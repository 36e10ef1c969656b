"""UCF101 (middle frames): ``ucf101/UCF-101-midframes/<Action_Name>/<video>.jpg`` and
``split_zhou_UCF101.json``.

Without the split file, it is generated from ``ucfTrainTestlist/classInd.txt`` (``1
ApplyEyeMakeup``; label = id - 1), ``trainlist01.txt`` and ``testlist01.txt`` (split 1): the
CamelCase action becomes the class and folder name ``Apply_Eye_Makeup``, ``.avi`` becomes
``.jpg``, and the training list is split 80/20 per class into train/val.
"""

from __future__ import annotations

import os.path as osp
import re

from engine.data import Datum, split_trainval
from engine.registry import DATASET_REGISTRY

from .common import CoOpDataset, Download, Layout

LAYOUT = Layout(
    name="UCF101",
    folder="ucf101",
    required=("UCF-101-midframes/",),
    split_file="split_zhou_UCF101.json",
    generated_from=(
        "ucfTrainTestlist/classInd.txt",
        "ucfTrainTestlist/trainlist01.txt",
        "ucfTrainTestlist/testlist01.txt",
    ),
    class_dirs=("UCF-101-midframes",),
    num_classes=101,
    how=(
        "The paper uses the middle frame of every UCF101 video, as prepared by CoOp "
        "(UCF-101-midframes.zip, Google Drive, see tools/download_data.py); unpack it in "
        "DATASET.ROOT/ucf101/ so that ucf101/UCF-101-midframes/<Action_Name>/*.jpg exists. Put "
        "CoOp's split_zhou_UCF101.json in ucf101/ to use the paper's split (without it a first "
        "run generates one from the official ucfTrainTestlist/ folder of "
        "UCF101TrainTestSplits-RecognitionTask.zip, crcv.ucf.edu, unpacked in ucf101/)."
    ),
    downloads=(
        Download(
            "gdrive:10Jqome3vtUA2keJkNanAiFpgbyC9Hc2O",
            "UCF-101-midframes.zip",
            extract=True,
            provides="UCF-101-midframes/",
        ),
        Download("gdrive:1I0S0q91hJfsV9Gf4xDIjgDq4AqBNJb1y", "split_zhou_UCF101.json"),
    ),
)


def split_camel_case(action: str) -> str:
    """``ApplyEyeMakeup`` -> ``Apply_Eye_Makeup`` (CoOp's class and folder names)."""
    return "_".join(re.findall("[A-Z][^A-Z]*", action))


@DATASET_REGISTRY.register()
class UCF101(CoOpDataset):
    layout = LAYOUT
    image_subdir = "UCF-101-midframes"

    def generate_split(self, rng):
        cname2lab = {}
        path = osp.join(self.dataset_dir, "ucfTrainTestlist", "classInd.txt")
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                label, _, action = line.strip().partition(" ")
                if not label.isdigit() or not action:
                    raise ValueError(f"{path}:{n}: expected '<id> <Action>', got {line.strip()!r}")
                cname2lab[action] = int(label) - 1
        trainval = self.read_list("trainlist01.txt", cname2lab)
        test = self.read_list("testlist01.txt", cname2lab)
        train, val = split_trainval(trainval, p_val=0.2, rng=rng)
        return train, val, test

    def read_list(self, filename: str, cname2lab: dict[str, int]) -> list[Datum]:
        path = osp.join(self.dataset_dir, "ucfTrainTestlist", filename)
        items = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                video = line.strip().split(" ")[0]  # trainlist lines also carry the class id
                if not video:
                    continue
                action, _, filename_avi = video.partition("/")
                if action not in cname2lab:
                    raise ValueError(f"{path}:{n}: action {action!r} is not in classInd.txt")
                classname = split_camel_case(action)
                impath = osp.join(self.image_dir, classname, filename_avi.replace(".avi", ".jpg"))
                items.append(Datum(impath=impath, label=cname2lab[action], classname=classname))
        return items
