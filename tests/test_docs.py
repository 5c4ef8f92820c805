"""The documentation holds together: nothing in the repository points outside it, every relative link of
README.md, docs/*.md and schemas/*.md reaches a file of the repository, and every #anchor a heading (by GitHub's
rules) or an explicit anchor of the page it names."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# spelled in two pieces, so that this file does not hold what it looks for
OUTSIDE_NOTES = ".." + "/shared"
PATH_TOKEN = re.compile(r"[A-Za-z0-9_.~/-]+")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT = re.compile(r"<[A-Za-z][^>]*?\s(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


@lru_cache(maxsize=1)
def repository_files() -> tuple[str, ...]:
    """Every file git tracks, and the new ones it does not ignore (a page written but not yet committed)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                          capture_output=True, check=True)
    return tuple(sorted({p for p in done.stdout.decode().split("\0") if p and (ROOT / p).is_file()}))


def text_of(rel: str) -> str | None:
    data = (ROOT / rel).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def climbs_out(rel_file: str, token: str) -> bool:
    """Whether ``token``, read as a path relative to the folder of the file it is written in, leaves the
    repository at any step."""
    depth = len(Path(rel_file).parts) - 1
    for part in token.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def test_nothing_in_the_repository_points_outside_it():
    found = []
    for rel in repository_files():
        text = text_of(rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_NOTES in line:
                found.append(f"{rel}:{n}: names {OUTSIDE_NOTES}")
                continue
            for token in PATH_TOKEN.findall(line):
                if ".." in token.split("/") and climbs_out(rel, token):
                    found.append(f"{rel}:{n}: {token} climbs out of the repository")
    assert not found, "\n".join(found)


def prose(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans and HTML comments blanked; line breaks
    stay where they were, so an offset still gives its line (a link's text may wrap)."""
    text = re.sub(r"<!--.*?-->", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if m or fence is not None:
            if m:
                fence = None if fence == m.group(1) else (fence or m.group(1))
            out.append("")
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda c: " " * len(c.group(0)), line))
    return "\n".join(out)


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image in the prose of ``text``."""
    body = prose(text)
    return [(body.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(body)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (markup dropped), lower-case, every character but letters,
    digits, spaces, ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors_of(path: Path) -> frozenset[str]:
    text = path.read_text()
    found: set[str] = set(EXPLICIT.findall(text))
    seen: dict[str, int] = {}
    for _, line in prose_lines_keeping_code(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def prose_lines_keeping_code(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, as written (a heading's code spans count for its anchor)."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m or fence is not None:
            if m:
                fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        out.append((n, line))
    return out


def pages() -> list[str]:
    """The front page, the documentation, and the contracts it links to."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for folder in ("docs", "schemas")
                                 for p in (ROOT / folder).glob("*.md"))]


def test_there_are_pages_to_check():
    assert (ROOT / "README.md").is_file()
    assert len(pages()) > 1, "docs/ holds no page"


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_resolves(page: str):
    source = ROOT / page
    broken = []
    for n, target in links(source.read_text()):
        if not target or SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (source.parent / path).resolve() if path else source
        where = f"{page}:{n}: ({target})"
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{where} leaves the repository")
        elif not dest.exists():
            broken.append(f"{where}: no such file")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{where}: an anchor into a file that is not Markdown")
        elif anchor and anchor not in anchors_of(dest):
            broken.append(f"{where}: {dest.relative_to(ROOT)} has no heading or id {anchor!r}")
    assert not broken, "\n".join(broken)


def test_the_slug_rules_are_githubs():
    assert slug("Batches: the OpenAI Batch API on the fleet's queue") == \
        "batches-the-openai-batch-api-on-the-fleets-queue"
    assert slug("Benchmarks (measured here, 2 cores)") == "benchmarks-measured-here-2-cores"
    assert slug("`nodeagent doctor`") == "nodeagent-doctor"
    assert slug("Settings: one name, one meaning") == "settings-one-name-one-meaning"
    assert slug("A [linked](x.md) *heading*") == "a-linked-heading"
    assert slug("snake_case and a - dash") == "snake_case-and-a---dash"


def test_the_checks_catch_what_they_should(tmp_path: Path):
    assert climbs_out("README.md", OUTSIDE_NOTES + "/docs/fleet.md")
    assert climbs_out("docs/fleet.md", "/".join(["..", "..", "x"]))
    assert not climbs_out("docs/fleet.md", "../schemas/redis-contract.md")
    assert not climbs_out(".ci/run", "/../scripts/test")  # after "$(dirname "$0")": from the file's folder
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n## Title\n\n<a id=\"here\"></a>\n```\n# not a heading\n```\n")
    assert anchors_of(page) == {"title", "title-1", "here"}
    assert links("[a](b.md) `[c](d.md)`\n```\n[e](f.md)\n```\n[wrapped\ntext](g.md#h) <!-- [i](j.md) -->\n") == \
        [(1, "b.md"), (5, "g.md#h")]
