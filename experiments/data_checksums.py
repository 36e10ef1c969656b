"""The recorded checksums of the datasets' public archives (``tools/download_data.py``).

Keys are the files' paths under the dataset root (``<dataset folder>/<file name>``); values are
``(algorithm, hex digest, where the digest was published)``. Only published digests are
recorded here: the MD5s that torchvision's dataset modules check for the same archives
(torchvision 0.29.1, ``torchvision/datasets/<module>.py``). Every other file (CoOp's Google
Drive files, archives whose hosts publish no checksum) is pinned on its first download in the
root's lock file (:data:`tools.download_data.LOCK_FILE`, SHA256) and checked against it ever after.

A table passed to ``tools/download_data.py --checksums FILE`` (JSON ``{"<key>": ["md5" or
"sha256", "<digest>"]}``) replaces this one as a whole, e.g. for a mirror whose archives are
repacked; the tests serve tiny archives that way, never by changing this table.
"""

from __future__ import annotations

TORCHVISION = "torchvision 0.29.1, torchvision/datasets/"

PUBLISHED: dict[str, tuple[str, str, str]] = {
    "caltech-101/caltech-101.zip": (
        "md5",
        "3138e1922a9193bfa496528edbbc45d0",
        TORCHVISION + "caltech.py",
    ),
    "dtd/dtd-r1.0.1.tar.gz": ("md5", "fff73e5086ae6bdbea199a49dfb8a4c1", TORCHVISION + "dtd.py"),
    "eurosat/EuroSAT.zip": ("md5", "c8fa014336c82ac7804f0398fcb19387", TORCHVISION + "eurosat.py"),
    "food-101/food-101.tar.gz": (
        "md5",
        "85eeb15f3717b99a5da872d97d918f87",
        TORCHVISION + "food101.py",
    ),
    "oxford_flowers/102flowers.tgz": (
        "md5",
        "52808999861908f626f3c1f4e79d11fa",
        TORCHVISION + "flowers102.py",
    ),
    "oxford_flowers/imagelabels.mat": (
        "md5",
        "e0620be6f572b9609742df49c70aed4d",
        TORCHVISION + "flowers102.py",
    ),
    "oxford_pets/images.tar.gz": (
        "md5",
        "5c4f3ee8e5d25df40f4fd59a7f44e54c",
        TORCHVISION + "oxford_iiit_pet.py",
    ),
    "oxford_pets/annotations.tar.gz": (
        "md5",
        "95a8c909bbe2e81eed6a22bccdf3f68f",
        TORCHVISION + "oxford_iiit_pet.py",
    ),
    "sun397/SUN397.tar.gz": ("md5", "8ca2778205c41d23104230ba66911c7a", TORCHVISION + "sun397.py"),
    # ImageNet's archives come by hand (image-net.org); their MD5s check what a person brings
    "imagenet/ILSVRC2012_img_train.tar": (
        "md5",
        "1d675b47d978889d74fa0da5fadfb00e",
        TORCHVISION + "imagenet.py",
    ),
    "imagenet/ILSVRC2012_img_val.tar": (
        "md5",
        "29b22e2961454d5413ddabcf34fc5622",
        TORCHVISION + "imagenet.py",
    ),
    "imagenet/ILSVRC2012_devkit_t12.tar.gz": (
        "md5",
        "fa75699e90414af021442c21a62c3abf",
        TORCHVISION + "imagenet.py",
    ),
}
