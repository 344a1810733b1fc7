"""The docs site cannot rot (issue 50): it builds in strict mode (a broken link, anchor or
reference fails), its API reference is current and covers every public name of ``hasten`` and
``hasten.utils`` (each with a docstring) and every public member of ``Accelerator`` (issue 61:
each with a docstring, so mkdocstrings renders it), and every Python block of the README and the
guides runs (on one process, beside small stand-ins for the ``model``, ``optimizer``, ``loader`` ...
a fragment uses) or, where a page says it needs several processes or files it does not show,
compiles. The pages keep two rules of form (issue 61): no prose paragraph over 120 words, and code
within the first 40 lines; the pages that do not yet are listed, and leave the list when they do."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
#: a page marks a block it cannot run here, and says why in its own text
COMPILE_ONLY = "<!-- docs-test: compile-only -->"
_BLOCK = re.compile(r"(<!-- docs-test: compile-only -->\n[ ]*)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str, bool]]:
    found = []
    for page in PAGES:
        for i, m in enumerate(_BLOCK.finditer(page.read_text(encoding="utf-8"))):
            source = textwrap.dedent(m.group(2))  # a block inside a list item is indented
            found.append((page.relative_to(ROOT).as_posix(), i, source, bool(m.group(1))))
    return found


BLOCKS = _blocks()


def _stand_ins() -> dict:
    """What the fragments use without defining it: one process's small objects."""
    sys.path.insert(0, str(ROOT / "examples"))
    from fsdp import TinyTransformer  # the sharding page's model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Tracker:
        def state_dict(self):
            return {"seen": 1}

        def load_state_dict(self, state):
            pass

    return {
        "torch": torch,
        "model": model,
        "optimizer": optimizer,
        "loader": torch.utils.data.DataLoader(data, batch_size=16),
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
        "loss_fn": torch.nn.functional.mse_loss,
        "my_tracker": Tracker(),
        "resume": False,
        "num_epochs": 1,
        "epochs": 1,
        "keep": lambda module, name: True,
        "TinyTransformer": TinyTransformer,
        "loss": torch.zeros(()),
    }


def test_every_block_is_found():
    assert len(BLOCKS) >= 10 and {page for page, *_ in BLOCKS} >= {"README.md", "docs/sharding.md"}


@pytest.mark.parametrize(("page", "index", "source", "compile_only"), BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in BLOCKS])
def test_python_block_runs(page, index, source, compile_only, tmp_path, monkeypatch):
    code = compile(source, f"{page} block {index}", "exec")
    if compile_only:
        text = (ROOT / page).read_text(encoding="utf-8")
        marker = [m.start() for m in _BLOCK.finditer(text)][index]
        assert "process" in text[max(0, marker - 400) : marker] or "checkpoint" in text[max(0, marker - 400) : marker]
        return  # the page says why it cannot run on one process here
    monkeypatch.chdir(tmp_path)
    namespace = _stand_ins()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(code, namespace)
    finally:
        accelerator = namespace.get("accelerator")
        if accelerator is not None:
            accelerator.end_training()


def _public(module) -> list[tuple[str, object]]:
    return [(n, getattr(module, n)) for n in module.__all__ if not n.startswith("__")]


def test_the_reference_pages_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gen_docs_reference.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_public_name_is_in_the_reference_with_a_docstring():
    import hasten
    import hasten.utils

    api = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    utils = (DOCS / "reference" / "utils.md").read_text(encoding="utf-8")
    undocumented = []
    for module, page in ((hasten, api), (hasten.utils, utils)):
        for name, obj in _public(module):
            listed = f"`from hasten import {name}`" in api or f"`from {module.__name__} import {name}`" in page
            assert listed, f"{module.__name__}.{name} is not in the reference"
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
                undocumented.append(f"{module.__name__}.{name}")
    assert undocumented == [], f"public names without a docstring: {undocumented}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed (make docs)")
def test_the_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for page in ("index.html", "launching/index.html", "reference/api/index.html", "reference/utils/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "gradient_accumulation_steps" in api  # mkdocstrings rendered Accelerator's signature
    rendered = set(re.findall(r'id="hasten\.accelerator\.Accelerator\.(\w+)"', api))
    missing = [name for name in _public_members() if name not in rendered]
    assert missing == [], f"Accelerator members the reference page does not show: {missing}"
    assert "strict_world_size" in api and "total_limit" in api  # save_state/load_state's own options


# ----------------------------------------------------------------------------- every member of the Accelerator


def _public_members() -> list[str]:
    from hasten import Accelerator

    return sorted(name for name in dir(Accelerator) if not name.startswith("_"))


def test_every_public_member_of_the_accelerator_has_a_docstring():
    """mkdocstrings shows a member only with a docstring (a property made with ``property(lambda ...)``
    has one as the string after it): griffe, which it reads the source with, must find them all."""
    griffe = pytest.importorskip("griffe")
    module = griffe.load("hasten.accelerator", search_paths=[str(ROOT / "src")], allow_inspection=False)
    members = {n: m for n, m in module["Accelerator"].all_members.items() if not n.startswith("_")}
    public = _public_members()
    assert len(public) >= 86 and sorted(members) == public  # what the reference reads is what Python has
    undocumented = [n for n in public if not (members[n].docstring and members[n].docstring.value.strip())]
    assert undocumented == [], f"Accelerator members without a docstring (left out of the reference): {undocumented}"


def test_the_accelerator_docstring_names_every_public_instance_attribute():
    from hasten import Accelerator

    accelerator = Accelerator(cpu=True)
    try:
        attributes = sorted(name for name in vars(accelerator) if not name.startswith("_"))
    finally:
        accelerator.end_training()
    assert len(attributes) >= 20
    assert [name for name in attributes if f"`{name}`" not in Accelerator.__doc__] == []


def test_save_state_and_load_state_show_their_options():
    from hasten import Accelerator

    for method, options in (
        (Accelerator.save_state, {"output_dir", "safe_serialization", "total_limit", "async_save"}),
        (Accelerator.load_state, {"input_dir", "weights_only", "verify_checksums", "strict_world_size", "missing_ok"}),
    ):
        parameters = inspect.signature(method).parameters
        assert set(parameters) - {"self"} == options, method.__name__
        assert all(p.kind is not p.VAR_KEYWORD for p in parameters.values())


# ----------------------------------------------------------------------------- the rules of form

MAX_PARAGRAPH_WORDS = 120
CODE_WITHIN_LINES = 40
_FENCE = re.compile(r"^\s*(```|~~~)")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")
_SNIPPET = re.compile(r'^--8<-- "([^":]+):([^"]+)"$', re.M)
#: lines that end a paragraph and are not prose: headings, tables, HTML, admonition heads, rules
_NOT_PROSE = ("#", "|", "<", "!!!", "???", "---", "***")


def _expanded(text: str) -> str:
    """The page with its ``--8<-- "FILE:SECTION"`` includes put in, as the site shows it."""

    def section(m: re.Match) -> str:
        source = (ROOT / m[1]).read_text(encoding="utf-8")
        start, end = f"--8<-- [start:{m[2]}]", f"--8<-- [end:{m[2]}]"
        return source[source.index(start) + len(start) : source.index(end)]

    return _SNIPPET.sub(section, text)


def prose_paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each prose paragraph: lines between blank lines outside code blocks,
    tables, headings and HTML; each list item is a paragraph of its own."""
    found: list[tuple[int, str]] = []
    current: list[tuple[int, str]] = []
    in_code = False

    def close() -> None:
        if current:
            found.append((current[0][0], " ".join(line for _, line in current)))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            close()
            in_code = not in_code
        elif not in_code:
            stripped = line.strip()
            if not stripped or stripped.startswith(_NOT_PROSE):
                close()
                continue
            if _LIST_ITEM.match(line):
                close()
            current.append((number, stripped))
    close()
    return found


def first_code_line(text: str) -> int | None:
    return next((n for n, line in enumerate(text.splitlines(), 1) if _FENCE.match(line)), None)


def test_the_rules_of_form_measure_what_they_say():
    code = "```python\nx = 1 " + "y " * 200 + "\n```"
    page = "# T\n\n" + "word " * 121 + f"\n\n{code}\n\n- an item\n  more\n- two\n\n| a | b |\n"
    assert [len(p.split()) for _, p in prose_paragraphs(page)] == [121, 4, 2]  # code and tables count for nothing
    assert first_code_line(page) == 5 and first_code_line("# no code\n") is None
    assert "```python" in _expanded('--8<-- "README.md:quickstart"')


def _pages() -> dict[str, str]:
    return {page.relative_to(ROOT).as_posix(): _expanded(page.read_text(encoding="utf-8")) for page in PAGES}


def test_no_prose_paragraph_over_120_words():
    long = {}
    for name, text in _pages().items():
        over = [(n, len(p.split())) for n, p in prose_paragraphs(text) if len(p.split()) > MAX_PARAGRAPH_WORDS]
        if over:
            long[name] = over
    assert long == {}, f"paragraphs over {MAX_PARAGRAPH_WORDS} words (line, words): split them, or use an admonition"


def test_every_page_shows_code_in_its_first_40_lines():
    late = sorted(name for name, text in _pages().items() if (first_code_line(text) or 10**9) > CODE_WITHIN_LINES)
    assert late == [], f"no code block in the first {CODE_WITHIN_LINES} lines of {late}: open with the code"


def test_recipes_are_task_sized():
    """docs/recipes.md: at least ten recipes, each a heading, two lines of prose and a block."""
    text = (DOCS / "recipes.md").read_text(encoding="utf-8")
    recipes = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(recipes) >= 10
    for recipe in recipes:
        title, body = recipe.split("\n", 1)
        prose = [p for _, p in prose_paragraphs(body)]
        assert len(prose) == 1 and len(prose[0].split()) <= 60, title  # two lines
        assert re.search(r"^```(python|bash)\n", body, re.M), title
