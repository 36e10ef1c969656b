"""The SAMPLe authors' trainer names and ``TRAINER.SAMPLe`` keys, as thin aliases.

The authors' released code base (HRajoliN/Sharpness-Aware-Minimization-in-VLMs) runs
``--trainer SAMPLe`` (CoOp's prompt learner), ``SAMPLeCoCoOp``, ``SAMPLeMAP`` (MaPLe) and
``SAMPLeSRC`` (PromptSRC), all reading their optimizer settings from ``TRAINER.SAMPLe``. Here
each name is the project's trainer of that prompt learner, and :meth:`translate_cfg` (called by
:func:`engine.cli.setup_cfg` after the config files and options, before the reproduction mode's
overlay and the freeze) maps the authors' keys onto this project's keys:

==========================  ======================================================================
``TRAINER.SAMPLe.``         becomes
==========================  ======================================================================
``ENBLR``                   ``None``: nothing (the base optimizer, or ``OPTIM.SAM.NAME`` as set);
                            ``SAM``: ``OPTIM.SAM.NAME sam``; ``SAMPLe``: ``OPTIM.SAM.NAME sample``
``RHO`` / ``ALPHA``         ``OPTIM.SAM.RHO`` / ``OPTIM.SAM.ALPHA`` (with ``SAM`` or ``SAMPLe``)
``EMA_LAMBDA``              ``OPTIM.SAM.LAMBDA`` (with ``SAM`` or ``SAMPLe``)
``ADAPTIVE``                ``OPTIM.SAM.ADAPTIVE`` with ``SAM``; refused with ``SAMPLe``
``NORMALIZATION``           False only with ``SAMPLe`` (the released normalised variant is not
                            implemented: refused); no effect otherwise, as in the released code
``REPRODUCTION``            ``REPRODUCTION`` (``released`` by default: the overlay
                            ``configs/repro/released.yaml``, see engine/repro.py; or ``paper``)
``N_CTX`` ``CSC``           ``SAMPLe`` only: its CoOp prompt learner is built from these (as the
``CTX_INIT`` ``PREC``       released SAMPLe trainer, which never reads ``TRAINER.COOP``); the other
``CLASS_TOKEN_POSITION``    aliases read their parent's node (``TRAINER.COCOOP``/``MAPLE``/
                            ``PROMPTSRC``) and ignore these, as the released code does
==========================  ======================================================================

Where the released code of one alias trains differently from the project's optimizer of the
same name, the ``released`` mode picks the optimizer that does what that code does:
``SAMPLeCoCoOp`` with ``SAMPLe`` (its copy of the optimizer has the moving average and the
exploration term commented out: ``e = rho g/||g|| - alpha g``, update ``0.5 g + 0.5 g_p``) is
``sagm`` (the ``reference-cocoop`` variant of ``sample`` up to SAGM's 1e-12 epsilon; the overlays
under ``configs/repro/released/<TRAINER>/`` are keyed by trainer name and do not apply to an
alias); ``SAMPLeSRC`` with ``SAM`` (its copy averages ``0.5 g + 0.5 g_p``) is ``sagm`` with
``ALPHA 0``. The ``paper`` mode always uses ``sam`` / ``sample``.
"""

from __future__ import annotations

import difflib

from engine.errors import ConfigError
from engine.registry import TRAINER_REGISTRY

from .cocoop import CoCoOp
from .coop import CoOp
from .maple import MaPLe
from .promptsrc import PromptSRC

NODE = "SAMPLe"  # the authors' node name (mixed case, as in their train.py)
ENBLR_CHOICES = ("None", "SAM", "SAMPLe")
MODES = ("released", "paper")  # engine.repro.MODES, the alias's default first
PROMPT_KEYS = ("N_CTX", "CSC", "CTX_INIT", "PREC", "CLASS_TOKEN_POSITION")


def add_sample_config(cfg) -> None:
    """``TRAINER.SAMPLe``: the authors' keys and defaults (their train.py), plus REPRODUCTION."""
    from yacs.config import CfgNode as CN

    if NODE in cfg.TRAINER:
        return
    node = CN()
    # CoOp prompt keys, read by the SAMPLe alias only (instead of TRAINER.COOP)
    node.N_CTX = 16  # number of context tokens (ignored when CTX_INIT is set)
    node.CSC = False  # class-specific context
    node.CTX_INIT = "a photo of a"  # initialisation words ("": random context)
    node.PREC = "fp32"  # fp32 | fp16 | amp | bf16
    node.CLASS_TOKEN_POSITION = "end"  # end | middle | front
    # the sharpness-aware step of every alias
    node.ENBLR = "None"  # None (OPTIM.SAM.NAME as configured: the base optimizer) | SAM | SAMPLe
    node.RHO = 0.2  # perturbation radius -> OPTIM.SAM.RHO
    node.ALPHA = 0.1  # step back along the batch-specific gradient -> OPTIM.SAM.ALPHA
    node.EMA_LAMBDA = 0.8  # moving-average factor -> OPTIM.SAM.LAMBDA
    node.NORMALIZATION = False  # the released optimizer's normalised variant: not implemented
    node.ADAPTIVE = False  # ASAM's scale-invariant perturbation (ENBLR SAM only)
    # released (emulate the authors' code: engine/repro.py) | paper (the method as written)
    node.REPRODUCTION = "released"
    cfg.TRAINER[NODE] = node


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        lower = {a.lower(): a for a in allowed}
        close = difflib.get_close_matches(str(value).lower(), list(lower), n=1, cutoff=0.5)
        hint = f" (do you mean {lower[close[0]]}?)" if close else ""
        raise ConfigError(
            f"TRAINER.{NODE}.{key} must be one of {', '.join(allowed)}; got {value!r}{hint}"
        )


def sam_keys(node, trainer: str) -> dict[str, object]:
    """The ``OPTIM.SAM`` keys that ``TRAINER.SAMPLe`` (``node``) sets for alias ``trainer``.

    Raises:
        ConfigError: an unknown ENBLR or a combination this project does not implement.
    """
    _choice("ENBLR", node.ENBLR, ENBLR_CHOICES)
    if node.ENBLR == "None":  # the released trainers' plain branch: no OPTIM.SAM key is touched
        return {}
    released = node.REPRODUCTION == "released"
    keys: dict[str, object] = {"OPTIM.SAM.RHO": node.RHO, "OPTIM.SAM.LAMBDA": node.EMA_LAMBDA}
    if node.ENBLR == "SAM":
        if released and trainer == "SAMPLeSRC":  # its SAM averages 0.5 g + 0.5 g_p
            keys.update({"OPTIM.SAM.NAME": "sagm", "OPTIM.SAM.ALPHA": 0.0})
        else:
            keys.update({"OPTIM.SAM.NAME": "sam", "OPTIM.SAM.ALPHA": node.ALPHA})
            keys["OPTIM.SAM.ADAPTIVE"] = node.ADAPTIVE
            return keys
    else:
        if node.NORMALIZATION:
            raise ConfigError(
                f"TRAINER.{NODE}.NORMALIZATION True (the released optimizer's variant that "
                "scales the exploration term by 1/||m|| instead of ||g||/||m||) is not "
                f"implemented; set TRAINER.{NODE}.NORMALIZATION False (the authors' scripts' "
                "default) or train OPTIM.SAM.NAME sample directly"
            )
        cocoop_copy = released and trainer == "SAMPLeCoCoOp"  # no moving average: SAGM-like
        keys["OPTIM.SAM.NAME"] = "sagm" if cocoop_copy else "sample"
        keys["OPTIM.SAM.ALPHA"] = node.ALPHA
    if node.ADAPTIVE:
        raise ConfigError(
            f"TRAINER.{NODE}.ADAPTIVE True with ENBLR {node.ENBLR} (trained here as "
            f"{keys['OPTIM.SAM.NAME']}) is not implemented: ASAM's adaptive perturbation exists "
            f"for ENBLR SAM only; set TRAINER.{NODE}.ADAPTIVE False"
        )
    return keys


def _set(cfg, full_key: str, value) -> None:
    node = cfg
    *parents, leaf = full_key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value


def coop_view(cfg):
    """A frozen copy of ``cfg`` whose ``TRAINER.COOP`` holds ``TRAINER.SAMPLe``'s prompt keys:
    the config that CoOp's model and checks see under the SAMPLe alias."""
    view = cfg.clone()
    view.defrost()
    for key in PROMPT_KEYS:
        view.TRAINER.COOP[key] = cfg.TRAINER[NODE][key]
    view.freeze()
    return view


class _AuthorsAlias:
    """Mixin of the aliases: the ``TRAINER.SAMPLe`` node and its translation.

    Attributes:
        PARENT_NODE: the ``TRAINER.<node>`` that the parent trainer's prompt learner reads.
        ALIAS_OF: the project's trainer that the alias runs (registry-driven tools may skip
            aliases: they train exactly what ``ALIAS_OF`` trains).
    """

    PARENT_NODE = ""
    ALIAS_OF = ""

    @classmethod
    def add_config(cls, cfg) -> None:
        if cls.PARENT_NODE not in cfg.TRAINER:
            super().add_config(cfg)
        add_sample_config(cfg)

    @classmethod
    def translate_cfg(cls, cfg) -> list[str]:
        node = cfg.TRAINER[NODE]
        _choice("REPRODUCTION", node.REPRODUCTION, MODES)
        name = TRAINER_REGISTRY.name_of(cls) or cls.__name__
        notes = []
        for key, value in sam_keys(node, name).items():
            _set(cfg, key, value)
            notes.append(f"TRAINER.{NODE} (ENBLR {node.ENBLR}) -> {key} {value}")
        cfg.REPRODUCTION = node.REPRODUCTION  # the alias's mode chooses the overlay
        return notes

    def check_cfg(self, cfg) -> None:
        mode = cfg.TRAINER[NODE].REPRODUCTION
        if cfg.REPRODUCTION != mode:
            raise ConfigError(
                f"REPRODUCTION {cfg.REPRODUCTION} (--repro or REPRODUCTION) and "
                f"TRAINER.{NODE}.REPRODUCTION {mode} disagree: the SAMPLe authors' aliases take "
                f"their mode from TRAINER.{NODE}.REPRODUCTION (released or paper); set only that"
            )
        super().check_cfg(cfg)


@TRAINER_REGISTRY.register()
class SAMPLe(_AuthorsAlias, CoOp):
    """The authors' ``SAMPLe``: CoOp with prompt keys under ``TRAINER.SAMPLe`` (TRAINER.COOP,
    which the authors' scripts also set, is not read: :func:`coop_view`)."""

    CONFIG_NODE = NODE
    PARENT_NODE = "COOP"
    ALIAS_OF = "CoOp"

    def check_cfg(self, cfg) -> None:
        super().check_cfg(coop_view(cfg))

    def build_model(self) -> None:
        cfg = self.cfg
        self.cfg = coop_view(cfg)  # CoOp's model reads TRAINER.COOP
        try:
            super().build_model()
        finally:
            self.cfg = cfg


@TRAINER_REGISTRY.register()
class SAMPLeCoCoOp(_AuthorsAlias, CoCoOp):
    """The authors' ``SAMPLeCoCoOp``: CoCoOp (prompt keys under ``TRAINER.COCOOP``)."""

    CONFIG_NODE = PARENT_NODE = "COCOOP"
    ALIAS_OF = "CoCoOp"


@TRAINER_REGISTRY.register()
class SAMPLeMAP(_AuthorsAlias, MaPLe):
    """The authors' ``SAMPLeMAP``: MaPLe (prompt keys under ``TRAINER.MAPLE``)."""

    CONFIG_NODE = PARENT_NODE = "MAPLE"
    ALIAS_OF = "MaPLe"


@TRAINER_REGISTRY.register()
class SAMPLeSRC(_AuthorsAlias, PromptSRC):
    """The authors' ``SAMPLeSRC``: PromptSRC (prompt keys under ``TRAINER.PROMPTSRC``)."""

    CONFIG_NODE = PARENT_NODE = "PROMPTSRC"
    ALIAS_OF = "PromptSRC"
