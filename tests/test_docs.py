"""The documentation site (docs/): every public name has an API entry and an example that uses it, every
example runs as written, and ``mkdocs build --strict`` passes, offline, when the docs extra is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import speedups
from tests._markdown import (
    fence_languages,
    python_blocks,
    run_block,
    run_block_under_torchrun,
    runs_under_torchrun,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
PAGES = sorted(DOCS.rglob("*.md"))
API_PAGES = sorted((DOCS / "api").glob("*.md"))
GUIDE_PAGES = [p for p in PAGES if p not in API_PAGES]
README = (ROOT / "README.md").read_text()
README_BLOCKS = set(python_blocks(README))

# Pages about one tip or topic open with when to use it (at most three lines), then a runnable example.
TIP_AND_TOPIC_PAGES = sorted(
    [*(DOCS / "tips").glob("*.md"), *(p for p in (DOCS / "gpu").glob("*.md") if p.name != "index.md")]
    + [
        DOCS / name
        for name in (
            "checkpoints.md", "lint.md", "long-runs.md", "metrics.md", "migration.md", "transformer.md",
        )
    ]
)


def _name(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


def _blocks() -> list[tuple[str, int, str]]:
    """``(page, index on the page, block)`` for every ```python block of docs/."""
    return [(_name(p), i, b) for p in GUIDE_PAGES for i, b in enumerate(python_blocks(p.read_text()))]


BLOCKS = _blocks()
BLOCK_IDS = [f"{page}:{index}" for page, index, _ in BLOCKS]


# ------------------------------------------------------------------------------------- what the pages hold
def _api_entries() -> list[str]:
    """The names after ``::: speedups.`` on the API pages (``speedups.X`` only, not deeper paths)."""
    found = []
    for page in API_PAGES:
        found += re.findall(r"^::: speedups\.(\w+)\s*$", page.read_text(), flags=re.M)
    return found


def test_every_public_name_has_one_api_entry() -> None:
    entries = _api_entries()
    missing = sorted(set(speedups.__all__) - set(entries))
    assert not missing, f"public names without a '::: speedups.NAME' entry under docs/api/: {missing}"
    twice = sorted({name for name in entries if entries.count(name) > 1})
    assert not twice, f"API entries listed twice: {twice}"
    unknown = sorted(set(entries) - set(speedups.__all__))
    assert not unknown, f"API entries for names speedups does not export: {unknown}"


def test_every_public_name_is_used_in_an_example() -> None:
    code = "\n".join(block for _, _, block in BLOCKS)
    unused = [name for name in speedups.__all__ if not re.search(rf"\b{re.escape(name)}\b", code)]
    assert not unused, f"public names no ```python block of docs/ uses: {unused}"


def test_every_page_is_in_the_nav() -> None:
    config = CONFIG.read_text()
    listed = set(re.findall(r"([\w/-]+\.md)\s*$", config, flags=re.M))
    missing = sorted(_name(p) for p in PAGES if _name(p) not in listed)
    assert not missing, f"pages missing from nav: in mkdocs.yml: {missing}"


def test_the_site_starts_with_the_readmes_two_commands() -> None:
    bash = re.compile(r"```bash\n(.*?)\n```", flags=re.S)
    assert bash.findall((DOCS / "index.md").read_text())[:2] == bash.findall(README)[:2]


def test_code_blocks_are_run_or_plainly_not_python() -> None:
    """A Python example is fenced ```python at the start of a line, so the tests find and run it."""
    allowed = {"python", "bash", "diff", "text", ""}
    for page in PAGES:
        for indent, language in fence_languages(page.read_text()):
            assert language in allowed, f"{_name(page)}: a ```{language} block (use one of {sorted(allowed)})"
            assert not (indent and language == "python"), f"{_name(page)}: an indented ```python block"


@pytest.mark.parametrize("page", TIP_AND_TOPIC_PAGES, ids=_name)
def test_a_page_opens_with_when_to_use_it_then_an_example(page: Path) -> None:
    text = page.read_text()
    body = text.split("\n", 1)[1].lstrip("\n")  # after the title
    first = body.split("\n\n", 1)[0]
    assert first.startswith("**When to use it:**"), f"{_name(page)} opens with {first[:60]!r}"
    assert len(first.splitlines()) <= 3, (
        f"{_name(page)}: 'When to use it' takes {len(first.splitlines())} lines"
    )
    fences = [language for _, language in fence_languages(text)]
    assert "python" in fences, f"{_name(page)} has no runnable example"
    assert "## " not in text[: text.index("```python")], f"{_name(page)}: a section before the first example"


# --------------------------------------------------------------------------------------- the examples run
@pytest.mark.slow
@pytest.mark.parametrize(("page", "index", "block"), BLOCKS, ids=BLOCK_IDS)
def test_docs_python_examples_run(page: str, index: int, block: str, tmp_path: Path) -> None:
    if block in README_BLOCKS:  # until the README is cut to its tour (issue 39), one run is enough
        pytest.skip("the same as a README block, which tests/test_package.py runs")
    out = run_block(block, tmp_path / f"docs_block_{index}.py")
    assert out.returncode == 0, f"{page} block {index}:\n{out.stderr[-3000:]}"


TORCHRUN_BLOCKS = [(p, i, b) for p, i, b in BLOCKS if runs_under_torchrun(b)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("page", "index", "block"), TORCHRUN_BLOCKS, ids=[f"{p}:{i}" for p, i, _ in TORCHRUN_BLOCKS]
)
def test_docs_distributed_examples_run_under_torchrun(
    page: str, index: int, block: str, tmp_path: Path
) -> None:
    """Blocks that start a process group run with 2 processes too; what rank 0 alone prints, prints once."""
    if block in README_BLOCKS:
        pytest.skip("the same as a README block, which tests/test_package.py runs under torchrun")
    out = run_block_under_torchrun(block, tmp_path / f"docs_ddp_{index}.py")
    assert out.returncode == 0, f"{page} block {index}:\n{out.stderr[-3000:]}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), f"{page} block {index}: a line printed by every rank:\n{out.stdout}"


# ------------------------------------------------------------------------------------------- the build
def _mkdocs_or_skip() -> None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as err:
        pytest.skip(f"the docs extra is not installed ({err.name} missing): pip install -e '.[docs]'")


@pytest.mark.slow
def test_mkdocs_build_is_strict_clean_and_offline(tmp_path: Path) -> None:
    _mkdocs_or_skip()
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # silences Material's end-of-life notice only
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    assert "WARNING" not in out.stderr, out.stderr[-5000:]
    pages = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("*.html")}
    assert "api/accumulate.html" in pages and "tips/fast-loader.html" in pages
    assert (site / "search" / "search_index.json").is_file()  # the search plugin ran
    fetched = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", flags=re.I)
    for name, html in pages.items():
        assert not fetched.search(html), f"{name} loads {fetched.search(html).group(0)!r}: nothing external"
        assert "fonts.googleapis" not in html, name
    for name in speedups.__all__:  # each entry rendered, under the id mkdocstrings gives it
        assert any(f'id="speedups.{name}"' in html for html in pages.values()), name
