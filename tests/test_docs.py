"""The documentation runs: every ```bash block of README.md and docs/*.md.

A block runs with ``bash -eo pipefail`` from a scratch copy of the repository (the top-level
entries linked, ``output/`` empty; one copy per page, its blocks in page order), with the
substitutions written once here (:func:`block_env`): ``DATA`` is a generated dataset root
(:func:`docs_data`), ``python`` is this interpreter, caches go to a temporary folder.

A block preceded by the line ``<!-- docs: static: <reason> -->`` (it needs a GPU, real data, real
CLIP weights, the network or many minutes) is checked statically instead, and so is every block
before it runs: bash syntax (``bash -n``), every repository file it names exists, every
``--flag`` given to a project tool (``train.py``, ``tools/*.py``, the protocol scripts, which pass
their options to ``tools/grid.py``) appears in that tool's ``--help``, and every ``KEY VALUE``
config key (UPPER.DOTTED) is a key of the full config (``engine.config.get_cfg_default`` with
every registered trainer and optimizer).

``python -m pytest -m docs`` runs them all; blocks that are executed are also ``slow``.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import io
import os
import os.path as osp
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache

import pytest
from conftest import ROOT

pytestmark = pytest.mark.docs

STATIC = re.compile(r"^\s*<!--\s*docs:\s*static:(.*?)-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
# an UPPER.DOTTED config key (segments start upper-case: TRAINER.SAMPLe.RHO; not README.md)
KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z][A-Za-z0-9_]*)+$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# repository entries whose paths a block may name (output/, plots/, ... are made by the blocks)
REPO_DIRS = ("assets", "configs", "datasets", "docs", "engine", "optim", "scripts", "tests")
REPO_DIRS += ("tools", "trainers")
REPO_FILES = ("train.py", "requirements.txt", "pyproject.toml", "README.md")
# the protocol scripts hand their --options to tools/grid.py
GRID_SCRIPTS = ("scripts/base2new.sh", "scripts/cross_dataset.sh", "scripts/domain_gen.sh")
GRID_SCRIPTS += ("scripts/few_shot.sh",)
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    """One ```bash block: its page (relative to the repository), its number in the page, the line
    of its opening fence, its text and its static reason (None: executed; "": no reason given)."""

    page: str
    index: int
    line: int
    text: str
    static: str | None

    @property
    def name(self) -> str:
        return f"{self.page} block {self.index} (line {self.line})"


def pages(root: str = ROOT) -> list[str]:
    return ["README.md", *sorted(osp.relpath(p, root) for p in glob.glob(f"{root}/docs/*.md"))]


def parse_blocks(page: str, text: str) -> list[Block]:
    """The ```bash blocks of a Markdown text, with the static marker of the line before each."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{page}:{i + 1}: a code block is never closed")
        if fence.group(1) == "bash":
            marker = STATIC.match(lines[i - 1]) if i else None
            static = marker.group(1).strip() if marker else None
            body = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(page, len(blocks) + 1, i + 1, body, static))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    out = []
    for page in pages():
        with open(osp.join(ROOT, page), encoding="utf-8") as f:
            out += parse_blocks(page, f.read())
    return out


# -- static checks -----------------------------------------------------------------------------
def commands(text: str) -> list[list[str]]:
    """The simple commands of a block as word lists (continuations joined, comments dropped,
    split at ``|``, ``&&``, ``;`` ...)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|<>()"):
                out.append(words)
                words = []
            else:
                words.append(token)
        out.append(words)
    return [c for c in out if c]


def tool_of(words: list[str]) -> tuple[str | None, list[str]]:
    """``(the project tool whose --help governs the flags, its arguments)`` of one command:
    ``python train.py ...`` / ``python tools/x.py ...`` / ``bash scripts/<protocol>.sh ...``."""
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if len(words) >= 2 and words[0] in ("python", "python3") and words[1].endswith(".py"):
        return words[1], words[2:]
    if len(words) >= 2 and words[0] == "bash" and words[1] in GRID_SCRIPTS:
        return "tools/grid.py", words[2:]
    return None, words[1:] if words else []


@cache
def help_text(tool: str) -> str:
    """``tool --help`` (``train.py`` or ``tools/<name>.py``): from its parser in this process
    (``build_parser()`` or ``main(["--help"])``), else from running it."""
    module = importlib.import_module(tool[:-3].replace("/", "."))
    if hasattr(module, "build_parser"):
        return module.build_parser().format_help()
    if hasattr(module, "main"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            module.main(["--help"])
        return out.getvalue()
    cmd = [sys.executable, osp.join(ROOT, tool), "--help"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60).stdout


@cache
def config_keys() -> frozenset[str]:
    """Every key of the full default config: engine keys, every registered trainer's node and
    the keys registered optimizers declare."""
    from engine.config import get_cfg_default

    def walk(node, prefix=""):
        for k, v in node.items():
            yield prefix + k
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")

    return frozenset(walk(get_cfg_default()))


def repo_path(word: str) -> str | None:
    """The repository path a word names (``configs/...``, ``train.py``), or None."""
    path = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
    if path in REPO_FILES or path.split("/", 1)[0] in REPO_DIRS and "/" in path:
        return path
    return None


def static_problems(block: Block, root: str = ROOT) -> list[str]:
    """What is wrong with a block without running it (empty: nothing)."""
    problems = []
    syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    if syntax.returncode:
        problems.append(f"bash syntax: {syntax.stderr.strip()}")
    for words in commands(block.text):
        tool, args = tool_of(words)
        # words of NAME=value assignments too (EXTRA_OPTS="OPTIM.MAX_EPOCH 1", DATA=...)
        every = [w for word in words for w in (word.split("=", 1)[1].split() if
                 ASSIGNMENT.match(word) else [word])]  # fmt: skip
        for word in every:
            path = repo_path(word)
            if path and not glob.glob(osp.join(root, path)):
                problems.append(f"{path}: no such file in the repository")
        if tool is None and not any(KEY.match(w) for w in every):
            continue
        for word in every if tool else [w for w in every if KEY.match(w)]:
            if KEY.match(word) and word not in config_keys():
                problems.append(f"{word}: not a config key (engine/config.py, the registries)")
        if tool is None or not osp.isfile(osp.join(root, tool)):
            continue
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag == "--":  # what follows goes on to train.py as KEY VALUE options
                break
            if not flag.startswith("--"):
                continue
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(tool)):
                problems.append(f"{flag}: not an option of {tool} (see its --help)")
    return problems


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.page}-{b.index}-L{b.line}")
def test_block_is_statically_sound(block):
    assert block.static != "", f"{block.name}: a static marker needs a reason"
    assert not static_problems(block), f"{block.name}:\n" + "\n".join(static_problems(block))


def test_static_check_catches_a_bad_flag_a_bad_key_and_a_missing_file():
    good = Block("x.md", 1, 1, "python train.py --root $DATA --seed 1 OPTIM.SAM.RHO 0.1\n", "r")
    assert static_problems(good) == []
    text = (
        "DATA=/data bash scripts/base2new.sh --no-such-grid-flag dtd OPTIM.SAM.RHOO 0.1\n"
        "python train.py --root $DATA --sed 1 \\\n"
        "  --config-file configs/trainers/CoOp/no_such.yaml OPTIM.NO_SUCH_KEY 2 # OPTIM.X 1\n"
        "python tools/make_tables.py --no-such-table-flag | tail -n 3\n"
        "python tools/grid.py --preset paper --dry-run -- --trainer-flag OPTIM.SAM.NAMEE sam\n"
        'EXTRA_OPTS="MODEL.NO_SUCH 1" bash scripts/SAMPLe/main.sh; if then\n'
    )
    found = "\n".join(static_problems(Block("x.md", 1, 1, text, "r")))
    for problem in (
        "--no-such-grid-flag: not an option of tools/grid.py",
        "OPTIM.SAM.RHOO: not a config key",
        "--sed: not an option of train.py",
        "configs/trainers/CoOp/no_such.yaml: no such file",
        "OPTIM.NO_SUCH_KEY: not a config key",
        "--no-such-table-flag: not an option of tools/make_tables.py",
        "MODEL.NO_SUCH: not a config key",
        "OPTIM.SAM.NAMEE: not a config key",
        "bash syntax",
    ):
        assert problem in found, f"{problem!r} not reported in:\n{found}"
    assert "OPTIM.X" not in found  # comments are not checked
    assert "--trainer-flag" not in found  # after "--": options of the runs, not of the tool


def test_blocks_are_found_with_their_markers():
    text = (
        "intro\n<!-- docs: static: needs a GPU -->\n```bash\nnvidia-smi\n```\n"
        "```python\nx = 1\n```\n```bash\necho a \\\n  b\n```\n<!-- docs: static: -->\n```bash\n"
        "ls\n```\n"
    )
    blocks = parse_blocks("p.md", text)
    assert [(b.index, b.line, b.static) for b in blocks] == [
        (1, 3, "needs a GPU"),
        (2, 9, None),
        (3, 14, ""),
    ]
    assert commands(blocks[1].text) == [["echo", "a", "b"]]


# -- links between the pages ------------------------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", pages())
def test_links_between_pages_resolve(page):
    bad = []
    for target in LINK.findall(open(osp.join(ROOT, page), encoding="utf-8").read()):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        full = (
            osp.normpath(osp.join(ROOT, osp.dirname(page), path)) if path else osp.join(ROOT, page)
        )
        if not osp.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            bad.append(f"{target}: no heading #{anchor} in {osp.relpath(full, ROOT)}")
    assert not bad, f"{page}:\n" + "\n".join(bad)


# -- running the blocks ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def docs_data(tmp_path_factory) -> str:
    """``$DATA`` of the executed blocks: a dataset root with a complete EuroSAT tree (its 10
    classes) and a generated DTD-layout dataset (7 of its classes)."""
    from dataset_trees import BUILDERS

    from datasets.synthetic import make_dtd

    root = str(tmp_path_factory.mktemp("docs_data"))
    BUILDERS["EuroSAT"](root)
    make_dtd(root, per_class=10)
    return root


def block_env(data: str, bin_dir: str, cache_dir: str) -> dict:
    """The substitutions, written once: data, interpreter, caches, one thread, no display."""
    return dict(
        os.environ,
        DATA=data,
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHON="python",
        SAMPLE_PL_CACHE=cache_dir,
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
        PYTHONDONTWRITEBYTECODE="1",
    )


class PageRun:
    """A scratch copy of the repository for one page; runs its blocks in page order."""

    def __init__(self, base: str, data: str):
        self.root = osp.join(base, "repo")
        os.makedirs(osp.join(self.root, "output"))
        for name in os.listdir(ROOT):
            if not name.startswith(".") and name not in ("output", "__pycache__"):
                os.symlink(osp.join(ROOT, name), osp.join(self.root, name))
        bin_dir = osp.join(base, "bin")
        os.makedirs(bin_dir)
        with open(osp.join(bin_dir, "python"), "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(osp.join(bin_dir, "python"), 0o755)
        self.env = block_env(data, bin_dir, osp.join(base, "cache"))
        self.done: set[int] = set()

    def run(self, block: Block) -> None:
        """Run ``block`` after the executed blocks before it in its page (a block may use what
        an earlier one made, as a reader following the page would)."""
        for earlier in blocks_of_page(block.page):
            if earlier.index >= block.index:
                break
            if earlier.static is None and earlier.index not in self.done:
                self._run(earlier)
        self._run(block)

    def _run(self, block: Block) -> None:
        self.done.add(block.index)
        proc = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", block.text],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        assert proc.returncode == 0, (
            f"{block.name} exited with {proc.returncode}:\n{block.text}\n"
            f"--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n"
            f"{proc.stderr[-3000:]}"
        )


def blocks_of_page(page: str) -> list[Block]:
    return [b for b in BLOCKS if b.page == page]


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory, docs_data):
    runs: dict[str, PageRun] = {}

    def get(page: str) -> PageRun:
        if page not in runs:
            base = str(tmp_path_factory.mktemp("docs_" + re.sub(r"\W", "_", page)))
            runs[page] = PageRun(base, docs_data)
        return runs[page]

    return get


EXECUTED = [b for b in BLOCKS if b.static is None]


@pytest.mark.slow
@pytest.mark.parametrize("block", EXECUTED, ids=lambda b: f"{b.page}-{b.index}-L{b.line}")
def test_block_runs(block, page_runs):
    page_runs(block.page).run(block)
