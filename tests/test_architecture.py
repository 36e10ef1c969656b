"""The seams: a one-way import graph, models built without datasets, one way to read a model's
outputs, config nodes found through the registry, Dassl's step names routed or refused."""

from __future__ import annotations

import ast
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from engine import build_trainer
from engine.registry import TRAINER_REGISTRY
from engine.trainer import ModelOutput, TrainerX

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

# optim at the bottom, the engine above it, trainers and datasets above the engine (and not
# importing each other), the experiment library (experiments/) above them, and the commands
# (tools/, train.py) on top. The compatibility layers for other code
# bases' files, dassl (Dassl's import paths) and clip (OpenAI's clip package), sit beside the
# trainers: they use the engine and optim only, and nothing of the project imports them.
LAYERS = {
    "optim": 0,
    "engine": 1,
    "trainers": 2,
    "datasets": 2,
    "dassl": 2,
    "clip": 2,
    "experiments": 3,
    "tools": 4,
    "train": 4,
}


def _imports(path: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in a file, lazy ones included."""
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _package_files():
    for pkg in LAYERS:
        if pkg == "train":
            yield pkg, osp.join(ROOT, "train.py")
            continue
        for dirpath, _, files in os.walk(osp.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield pkg, osp.join(dirpath, f)


def test_import_graph_is_one_way():
    bad = []
    for pkg, path in _package_files():
        for line, target in _imports(path):
            if target not in LAYERS or target == pkg:
                continue
            if LAYERS[target] >= LAYERS[pkg] or target == "train":
                bad.append(f"{osp.relpath(path, ROOT)}:{line} ({pkg}) imports {target}")
    assert not bad, "backward or sideways imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module,forbidden",
    [
        ("optim", ("engine", "trainers", "datasets", "experiments", "tools", "dassl", "clip")),
        ("engine", ("trainers", "datasets", "dassl", "clip")),
        ("dassl.engine", ("trainers", "datasets", "clip", "experiments", "tools")),
        ("experiments", ("tools", "train")),
    ],
)
@pytest.mark.slow
def test_importing_a_layer_loads_nothing_above_it(module, forbidden):
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"import {module} loaded {out}"


def test_tools_do_not_repeat_the_sys_path_prologue():
    tools = [f for f in os.listdir(osp.join(ROOT, "tools")) if f.endswith(".py")]
    offenders = [
        f
        for f in tools
        if f != "_repo.py" and "sys.path.insert" in open(osp.join(ROOT, "tools", f)).read()
    ]
    assert not offenders


def _tool_imports(path: str, package: str = "tools") -> set[str]:
    """The ``package`` modules a file imports (``from <package>.x import``, ``from <package>
    import x``), lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(package + "."):
                found.add(node.module.split(".")[1])
            elif node.module == package:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")
            )
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> imported modules), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return []


@pytest.mark.parametrize("package", ["tools", "experiments"])
def test_modules_import_each_other_without_a_cycle(package):
    folder = osp.join(ROOT, package)
    files = [f for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"]
    graph = {f[:-3]: _tool_imports(osp.join(folder, f), package) for f in files}
    assert _cycle(graph) == [], f"import cycle in {package}/: {' -> '.join(_cycle(graph))}"
    if package == "experiments":
        assert "report" not in graph["tables_model"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check


def test_tools_holds_commands_only():
    """Every module of ``tools/`` is a command (``python tools/<name>.py``); what other modules
    import lives in the experiment library, ``experiments/``."""
    folder = osp.join(ROOT, "tools")
    not_commands = [
        f
        for f in sorted(os.listdir(folder))
        if f.endswith(".py")
        and f != "_repo.py"
        and '__name__ == "__main__"' not in open(osp.join(folder, f)).read()
    ]
    assert not not_commands, (
        f"library modules in tools/ (move them to experiments/): {not_commands}"
    )
    imported = set()
    for base, _, files in os.walk(osp.join(ROOT, "experiments")):
        imported |= {
            m for f in files if f.endswith(".py") for m in _tool_imports(osp.join(base, f))
        }
    assert not imported, f"experiments/ imports the commands {sorted(imported)}"


# -- models without datasets -------------------------------------------------------------------
CLASSES = ["red circle", "blue square", "green_triangle"]
TRAINABLE = [n for n in sorted(TRAINER_REGISTRY) if not n.startswith("Zeroshot")]


def _cfg(trainer: str, tiny_clip_opts, tmp_path):
    from conftest import make_cfg
    from helpers import tiny_options

    opts = [*tiny_clip_opts, "OUTPUT_DIR", str(tmp_path / "out"), "DATASET.ROOT", "/nonexistent"]
    return make_cfg(opts + tiny_options(trainer, tmp_path, depth=2), trainer=trainer)


@pytest.mark.parametrize("trainer", sorted(TRAINER_REGISTRY))
def test_every_trainer_builds_from_class_names_and_reports_its_outputs(
    trainer, tiny_clip_opts, tmp_path
):
    cfg = _cfg(trainer, tiny_clip_opts, tmp_path)
    tr = build_trainer(cfg, classnames=CLASSES)
    assert tr.dm is None and tr.train_loader_x is None and tr.classnames == CLASSES
    size = tuple(cfg.INPUT.SIZE)
    image = torch.randn(2, 3, *size)
    tr.set_model_mode("eval")
    with torch.no_grad():
        out = tr.model_outputs(image)
        tr.before_test()
        logits = tr.model_inference(image)
        tr.after_test()
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, len(CLASSES))
    assert out.image_features.shape[0] == 2
    assert out.text_features.shape[-2] == len(CLASSES)
    norms = out.image_features.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-3)
    # the evaluation path (cached text features) gives the same logits
    torch.testing.assert_close(logits.float(), out.logits.float(), atol=1e-3, rtol=1e-3)
    with pytest.raises(RuntimeError, match="class names only|nothing to train"):
        tr.train()


def test_config_node_comes_from_the_registry_not_the_class_name(tiny_clip_opts, tmp_path):
    from trainers.coop import CoOp

    class Renamed(CoOp):  # a subclass reusing CoOp's keys under another class name
        pass

    assert Renamed.config_node() == "COOP"
    cfg = _cfg("CoOp", tiny_clip_opts, tmp_path)
    tr = Renamed(cfg, classnames=CLASSES)
    assert tr.trainer_cfg() is cfg.TRAINER.COOP
    assert tr.prec == cfg.TRAINER.COOP.PREC
    assert TRAINER_REGISTRY.get("ZeroshotCLIP2").config_node() == "ZEROSHOTCLIP"
    assert TRAINER_REGISTRY.get("CoPrompt").config_node() == "COPROMPT"


def test_dassl_step_names_route_through_the_step_or_point_to_the_protocol(tiny_clip_opts, tmp_path):
    cfg = _cfg("CoOp", tiny_clip_opts, tmp_path)
    tr = build_trainer(cfg, classnames=CLASSES)
    for call in (lambda: tr.model_update(), lambda: tr.model_backward(torch.zeros(()))):
        with pytest.raises(NotImplementedError, match="compute_loss"):
            call()
    # model_backward_and_update goes through the optimizer step (one-pass optimizers)
    before = tr.model.prompt_learner.ctx.detach().clone()
    tr.epoch = 0
    loss = tr.model_outputs(torch.randn(2, 3, *cfg.INPUT.SIZE)).logits.logsumexp(-1).mean()
    tr.model_backward_and_update(loss)
    assert not torch.equal(before, tr.model.prompt_learner.ctx.detach())
    # a sharpness-aware optimizer cannot be driven that way: a pointer, not a plain-SGD step
    from conftest import make_cfg

    cfg_sam = make_cfg([*cfg_opts(cfg), "OPTIM.SAM.NAME", "sam"], trainer="CoOp")
    tr_sam = build_trainer(cfg_sam, classnames=CLASSES)
    tr_sam.epoch = 0
    loss = tr_sam.model_outputs(torch.randn(2, 3, *cfg.INPUT.SIZE)).logits.logsumexp(-1).mean()
    with pytest.raises(RuntimeError, match="prepare_step"):
        tr_sam.model_backward_and_update(loss)


def cfg_opts(cfg) -> list[str]:
    """KEY VALUE options that rebuild ``cfg``'s backbone and output settings."""
    b = cfg.MODEL.BACKBONE
    opts = ["MODEL.BACKBONE.NAME", b.NAME, "MODEL.BACKBONE.CONFIG", b.CONFIG]
    opts += ["MODEL.BACKBONE.PATH", b.PATH, "OUTPUT_DIR", cfg.OUTPUT_DIR]
    from engine.clip.toy import TINY_OPTS

    return opts + list(TINY_OPTS)


def test_trainer_base_class_is_the_public_one():
    assert issubclass(TRAINER_REGISTRY.get("CoOp"), TrainerX)
    assert TRAINABLE  # the registry drives the shared tests


def test_make_toy_writes_a_clip_and_a_dataset(tmp_path):
    from tools import make_toy

    assert make_toy.main([str(tmp_path), "--per-class", "2"]) == 0
    assert osp.isfile(tmp_path / "tiny_clip.json") and osp.isfile(tmp_path / "tiny_clip.pt")
    classes = os.listdir(tmp_path / "data" / "dtd" / "images")
    assert len(classes) == 7 and all(
        len(os.listdir(tmp_path / "data" / "dtd" / "images" / c)) == 2 for c in classes
    )
