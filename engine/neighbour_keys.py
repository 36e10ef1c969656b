"""Config keys of the neighbouring code bases' trainers that this project does not have.

The CoOp family's repositories share Dassl's config tree and add their trainers' nodes to it
(their ``train.py``'s ``extend_cfg``). Where a config file or command line of one of them carries
the node of a trainer that is not registered here, the merge (engine/config.py) refuses it with
this table's explanation instead of a bare "unknown key": which trainer the key belongs to,
which code base ships it, and what to do instead. Keys of trainers that this project has are
translated by those trainers (:meth:`engine.trainer.TrainerBase.translate_key`).
"""

from __future__ import annotations

from .errors import ConfigError

# node -> (trainer, code base, what to use here instead)
FOREIGN_NODES = {
    "LOSS": (
        "ProGrad",
        "KgCoOp's code base (htyao89/KgCoOp: configs/trainers/ProGrad/, trainers/prograd.py)",
        "--trainer KgCoOp or CoOp with configs/trainers/KgCoOp/ or configs/trainers/CoOp/",
    ),
    "TRAINER.VPT": (
        "VPT",
        "MaPLe's code base (muzairkhattak/multimodal-prompt-learning: scripts/vpt/)",
        "the nearest is --trainer IVLP, deep prompts in both towers, configs/trainers/IVLP/",
    ),
    "TRAINER.PROMPTKD": (
        "PromptKD",
        "the SAMPLe authors' code base (HRajoliN/Sharpness-Aware-Minimization-in-VLMs)",
        "remove the TRAINER.PROMPTKD section (configs/trainers/SAMPLe*/ of this project have none)",
    ),
}


def foreign_node(full_key: str) -> str | None:
    """The :data:`FOREIGN_NODES` entry that ``full_key`` lies in, or None."""
    for node in FOREIGN_NODES:
        if full_key == node or full_key.startswith(node + "."):
            return node
    return None


def foreign_key_error(full_key: str, source: str) -> ConfigError | None:
    """The refusal of a key of a trainer this project does not have, or None."""
    node = foreign_node(full_key)
    if node is None:
        return None
    trainer, code_base, instead = FOREIGN_NODES[node]
    return ConfigError(
        f"Config key '{full_key}' in {source} belongs to {trainer}, a trainer of {code_base} "
        f"that this project does not have ({node} is its config node). Train a trainer of this "
        f"project instead ({instead}), or remove the {node} keys."
    )
