"""The documentation's relative links and images point at files (and headings) that exist.

Checked: README.md, docs/*.md and benchmarks/README.md. A link is ``[text](target)``,
``![alt](target)`` or a reference definition ``[label]: target``, outside fenced code blocks and
inline code. Links with a scheme (``https:``, ``mailto:``) are not followed. A ``#anchor`` into a
markdown file must be the GitHub slug of one of its headings. The README stays a front door: at
most :data:`README_MAX_LINES` lines. Standard library only: this tier never imports megatron.
"""

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1)(?:[^\n]|\n(?![ \t]*\n)))+?\1")  # may span lines, not paragraphs
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\"|\s+'[^']*')?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)[0] * len(m.group(1))
            elif m.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def _prose(text: str) -> str:
    """``text`` with fenced blocks and inline code blanked out, line numbers kept."""
    lines = text.splitlines()
    keep = dict(_prose_lines(text))
    prose = "\n".join(keep.get(n, "") for n in range(1, len(lines) + 1))
    return _INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in markdown ``text``; link text may wrap."""
    prose = _prose(text)
    found = [(prose.count("\n", 0, m.start()) + 1, m.group(1).strip("<>")) for m in _INLINE_LINK.finditer(prose)]
    for number, line in enumerate(prose.splitlines(), 1):
        m = _REF_DEF.match(line)
        if m:
            found.append((number, m.group(1).strip("<>")))
    return sorted(found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a markdown file offers: its headings' slugs (repeats get -1, -2, ...) and HTML ids."""
    seen: dict[str, int] = {}
    out = set(_HTML_ID.findall(text))
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """One line per link of ``path`` whose file or anchor does not exist (paths shown from ``root``)."""
    text = path.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        if not target or _SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
        if not dest.exists():
            problems.append(f"{where}: {shown} does not exist")
        elif (
            anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest.read_text(encoding="utf-8"))
        ):
            problems.append(f"{where}: no heading of {shown} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_exist(path):
    assert path.is_file(), f"{path} is missing"
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_have_links_to_check():
    # An empty result must mean "nothing broken", not "nothing parsed".
    readme = links((REPO / "README.md").read_text(encoding="utf-8"))
    targets = {t for _, t in readme}
    assert len(readme) >= 10
    assert "docs/ppo_memory_timeline_cpu_tiny.png" in targets
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md") if p.name != "README.md"} <= {
        t.partition("#")[0] for t in targets
    }, "the README's index must list every page of docs/"


def test_the_checker_finds_a_broken_file_and_anchor(tmp_path):
    tmp_path = tmp_path.resolve()
    (tmp_path / "other.md").write_text("# Other page\n\n## Some `code` heading: why?\n\n## Repeat\n\n## Repeat\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](other.md#some-code-heading-why) [ok](other.md#repeat-1) [ok](#title)\n"
        "![gone](missing.png) [bad](other.md#nope) [web](https://example.com/x.md)\n"
        "```\n[in a fence](nowhere.md)\n```\n`[inline](nowhere.md)`\na [wrapped\nlink](gone.md)\n"
        "[ref]: also_missing.md\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert "missing.png" in problems[0] and "#nope" in problems[1]
    assert "page.md:9: gone.md" in problems[2] and "also_missing.md" in problems[3]


def test_slugs_follow_github():
    assert (
        slug("Mixing with megatron-core's own offload is caught") == "mixing-with-megatron-cores-own-offload-is-caught"
    )
    assert slug("Colocated PPO through Ray (`ray_actors/`, installed as `chatlearn_mem_ray`)") == (
        "colocated-ppo-through-ray-ray_actors-installed-as-chatlearn_mem_ray"
    )
    assert slug("`policy`, `critic`") == "policy-critic"


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: move the details to a page under docs/ and link it"
    )
