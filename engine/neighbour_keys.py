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
    "TRAINER.VPT": (
        "VPT",
        "MaPLe's code base (muzairkhattak/multimodal-prompt-learning: scripts/vpt/)",
        "the nearest is --trainer IVLP, deep prompts in both towers, configs/trainers/IVLP/",
    ),
    "TRAINER.MMRLpp": (
        "MMRL++",
        "MMRL's code base (yunncheng/MMRL: configs/trainers/MMRLpp/, trainers/mmrlpp.py)",
        "--trainer MMRL with configs/trainers/MMRL/, MMRL++'s predecessor (MMRL's own "
        "representation tokens; MMRL++'s shared-residual aligner and progressive composition "
        "are not here yet)",
    ),
    "TRAINER.PROMPTKD": (
        "PromptKD",
        "the SAMPLe authors' code base (HRajoliN/Sharpness-Aware-Minimization-in-VLMs)",
        "remove the TRAINER.PROMPTKD section (configs/trainers/SAMPLe*/ of this project have none)",
    ),
}


# Keys of a neighbour's layout of a trainer that this project has (its trainer reads them):
# key or node -> (neighbour, code base, the command that works here)
_KGCOOP_TCP = (
    "KgCoOp's and TCP's",
    "KgCoOp's or TCP's code base (htyao89/KgCoOp, "
    "htyao89/Textual-based_Class-aware_prompt_tuning), whose train.py declares it in CoOp's node",
    "--trainer KgCoOp or --trainer TCP, which read these files' TRAINER.COOP keys (their own "
    "scripts and configs run unchanged, docs/neighbours.md)",
)
_COPROMPT = (
    "CoPrompt's",
    "CoPrompt's code base (ShuvenduRoy/CoPrompt: configs/trainers/coprompt.yaml)",
    "--trainer CoPrompt, which reads CoPrompt's TRAINER.CoPrompt, TRAINER.W and "
    "TRAINER.DISTILL keys (its own scripts and configs run unchanged, docs/neighbours.md)",
)
_PROGRAD = (
    "ProGrad's",
    "ProGrad's code base (BeierZhu/Prompt-align; KgCoOp's and TCP's repositories carry copies "
    "of its configs/trainers/ProGrad/ and trainers/prograd.py), whose train.py declares it",
    "--trainer ProGrad, which reads ProGrad's LOSS.* and TRAINER.COOP.* keys (its own configs "
    "and scripts run unchanged, docs/neighbours.md); or ProGrad's own trainers/prograd.py as a "
    "plugin, which brings these keys along: PYTHONPATH=<ProGrad's repository> python train.py "
    "--plugin trainers.prograd --trainer ProGrad ..., docs/porting-trainers.md",
)
NEIGHBOUR_LAYOUTS = {
    "LOSS": _PROGRAD,  # ProGrad's (trainers/prograd.py reads them as TRAINER.PROGRAD.*)
    "TASK": (
        "MMRL's",
        "MMRL's code base (yunncheng/MMRL), whose train.py declares it at the top level",
        "--trainer MMRL, which reads TASK as TRAINER.MMRL.TASK (its own scripts and configs "
        "run unchanged, docs/neighbours.md)",
    ),
    "TRAINER.COOP.W": _KGCOOP_TCP,
    "TRAINER.COOP.ALPHA": _KGCOOP_TCP,
    "TRAINER.CoPrompt": _COPROMPT,
    "TRAINER.W": _COPROMPT,
    "TRAINER.DISTILL": _COPROMPT,
}


def _lies_in(full_key: str, node: str) -> bool:
    return full_key == node or full_key.startswith(node + ".")


def neighbour_layout_error(full_key: str, source: str) -> ConfigError | None:
    """The refusal of a key of a known neighbour's layout that the run's trainer does not
    read, naming the neighbour and the command that works; or None."""
    for node, (neighbour, code_base, command) in NEIGHBOUR_LAYOUTS.items():
        if _lies_in(full_key, node):
            return ConfigError(
                f"Config key '{full_key}' in {source} is a key of {neighbour} layout "
                f"({code_base}), which the trainer of this run does not read. Run these "
                f"files with {command}."
            )
    return None


def close_key(known: list[str], full_key: str) -> str | None:
    """The known key nearest to the unknown trainer key ``full_key`` (``TRAINER.*``) within its
    own scope: a key of a trainer's node is compared with the keys of that node only (never
    another trainer's), an unknown trainer node only with the same node name in other case,
    and ``TRAINER.<X>`` with the engine's own ``TRAINER.*`` keys (``NAME``)."""
    import difflib

    parts = full_key.split(".")
    nodes = {k for k in known if k.startswith("TRAINER.") and k.count(".") == 1}
    if len(parts) >= 3:
        node = f"TRAINER.{parts[1]}"
        if node in known:
            inside = [k[len(node) + 1 :] for k in known if k.startswith(node + ".")]
            close = difflib.get_close_matches(".".join(parts[2:]), inside, n=1, cutoff=0.6)
            return f"{node}.{close[0]}" if close else None
        same = [k for k in nodes if k.upper() == node.upper()]
        return f"{same[0]}.{'.'.join(parts[2:])}" if same else None
    own = [k for k in nodes if not any(j.startswith(k + ".") for j in known)]  # leaves only
    close = difflib.get_close_matches(full_key, own, n=1, cutoff=0.6)
    return close[0] if close else None


def foreign_node(full_key: str) -> str | None:
    """The :data:`FOREIGN_NODES` entry that ``full_key`` lies in, or None."""
    for node in FOREIGN_NODES:
        if _lies_in(full_key, node):
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


# The keys that the train.py of a neighbour's code base declares (its extend_cfg) for its trainer
# file of this class name and that this project's config lacks: added when such a file is the
# loaded trainer (dassl.engine.TrainerX.add_config), so that e.g. KgCoOp's kgcoop.py finds
# TRAINER.COOP.W and ProGrad's prograd.py its LOSS.* keys. Values: their train.py's defaults.
_COOP_LAYOUT = {"TRAINER.COOP.W": 1.0, "TRAINER.COOP.ALPHA": 1.0}
_PROGRAD_LAYOUT = {
    **_COOP_LAYOUT,
    "LOSS.GM": False,
    "LOSS.NAME": "",
    "LOSS.ALPHA": 0.0,
    "LOSS.T": 1.0,
    "LOSS.LAMBDA": 1.0,
}
FILE_KEYS = {
    "KgCoOp": _COOP_LAYOUT,  # htyao89/KgCoOp
    "TCP": _COOP_LAYOUT,  # htyao89/Textual-based_Class-aware_prompt_tuning
    "ProGrad": _PROGRAD_LAYOUT,  # BeierZhu/Prompt-align
    "CoPrompt": {  # ShuvenduRoy/CoPrompt
        "TRAINER.CoPrompt.N_CTX": 2,
        "TRAINER.CoPrompt.CTX_INIT": "a photo of a",
        "TRAINER.CoPrompt.PREC": "fp16",
        "TRAINER.CoPrompt.PROMPT_DEPTH": 9,
        "TRAINER.W": 8.0,
        "TRAINER.DISTILL": "cosine",
    },
}


def add_file_keys(cfg, name: str) -> list[str]:
    """Add the :data:`FILE_KEYS` of the trainer file class ``name`` that ``cfg`` lacks."""
    from yacs.config import CfgNode

    added = []
    for key, value in FILE_KEYS.get(name, {}).items():
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            if part not in node:
                node[part] = CfgNode()
            node = node[part]
        if leaf not in node:
            node[leaf] = value
            added.append(key)
    return added


CTX_INIT_WORDS = "a photo of a"  # what the neighbours' files use when CTX_INIT is true


def ctx_init_words(key: str, value) -> list[tuple[str, object]]:
    """A neighbour's boolean ``<NODE>.CTX_INIT`` as words: True -> "a photo of a" (what
    KgCoOp's, TCP's and ProGrad's files initialise from when it is true), False -> "" (a random
    context); any other key or value unchanged."""
    if key.endswith(".CTX_INIT"):
        text = value.strip().lower() if isinstance(value, str) else value
        if text in (True, "true"):
            return [(key, CTX_INIT_WORDS)]
        if text in (False, "false"):
            return [(key, "")]
    return [(key, value)]
