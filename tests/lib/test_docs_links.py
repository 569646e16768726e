"""The README is the front door and `docs/` the manual (issue 33): every relative link in them
points at a file that exists (and at a heading of it, for `page.md#anchor`), every repository
path they name exists, and the README keeps the two newcomer commands and stays small.
Read as text: nothing is imported or run."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_BUDGET_CHARS = 12_000
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`]+)`")
# A path the docs give from the repository root, or from lib/posttrain/ (`data/sources.py`).
_ROOT_DIRS = ("lib", "steps", "flows", "configs", "assets", "bench", "tests", "tools", "infra",
              "docs")
_FILE_EXT = (".py", ".yaml", ".yml", ".md", ".json", ".jsonl", ".sh", ".txt", ".toml")
# Files a run writes (not in the repository), or an example name the docs make up.
_NOT_IN_REPO = {"result.json", "metrics.jsonl", "lineage.json", "event_vocab.json", "heads.json",
                "meta.json", "manifest.json", "my_envs.py", "my_rewards.py",
                "gpu_suite.jsonl", "mmlu_test.jsonl", "rank-*.json", "trackers.json"}


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code-block lines) of a markdown text."""
    prose, code, fence = [], [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fence = not fence
            continue
        (code if fence else prose).append(line)
    return prose, code


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose, _ = _split(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _brace_expand(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",")
            for x in _brace_expand(token[:m.start()] + alt + token[m.end():])]


def _path_exists(token: str, basenames: set[str]) -> bool:
    for candidate in _brace_expand(token):
        if "/" not in candidate:
            if candidate not in basenames:
                return False
            continue
        base = ROOT if candidate.split("/")[0] in _ROOT_DIRS else ROOT / "lib" / "posttrain"
        if not glob.glob(str(base / candidate)):
            return False
    return True


def _path_tokens(prose: list[str], code: list[str]) -> set[str]:
    """Repository paths named in code spans (any file name with a known extension, or a path
    under a top-level directory) and, in code blocks, paths under a top-level directory."""
    tokens = set()
    spans = [s for line in prose for s in _CODE_SPAN.findall(line)]
    for words, bare_names in ((spans, True), (code, False)):
        for word in (w for text in words for w in text.split()):
            word = word.strip(",;:()'\"")
            if not word or "<" in word or "://" in word or word.startswith(("/", "..", "$", "~")):
                continue
            top = word.split("/")[0]
            is_root_path = "/" in word and top in _ROOT_DIRS
            is_file = word.endswith(_FILE_EXT) and re.fullmatch(r"[\w{*][\w./{},*-]*", word)
            if is_root_path or (bare_names and is_file and "/" in word):
                tokens.add(word)
            elif bare_names and is_file and word not in _NOT_IN_REPO:
                tokens.add(word)
    return tokens


@pytest.fixture(scope="module")
def basenames() -> set[str]:
    out = {p.name for p in ROOT.iterdir() if p.is_file()}
    for top in _ROOT_DIRS:
        out.update(p.name for p in (ROOT / top).rglob("*") if p.is_file())
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(page: Path, basenames: set[str]) -> None:
    prose, code = _split(page.read_text())
    broken = []
    for line in prose:
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue                        # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"link {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"link {target}: no heading #{anchor} in {dest.name}")
    for token in sorted(_path_tokens(prose, code)):
        if not _path_exists(token, basenames):
            broken.append(f"path `{token}`: not in the repository (a file a run writes: "
                          "add it to _NOT_IN_REPO)")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_is_the_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= README_BUDGET_CHARS, (
        f"README.md is {len(text)} characters (budget {README_BUDGET_CHARS}): move the detail "
        "into a docs/ page and link it")
    first_block = re.search(r"^```\n(.*?)^```", text, re.S | re.M)
    assert first_block, "README.md lost its first code block (the two newcomer commands)"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make run", "make test"], (
        "a fresh machine needs exactly `make run` and `make test`, first in README.md")
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"
