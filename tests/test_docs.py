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


# -- every command the docs tell a person to type exists, with every flag they give it ------------------------------
SHELL_INFO = ("sh", "bash", "shell", "console", "")
PROGRAM = re.compile(r"^(?:\.venv/bin/|/opt/nodeagent/bin/|\$NA$|\$VENV/bin/)?nodeagent$")


def _command_words(segment: str) -> list[str] | None:
    """The words after `nodeagent` when a shell segment runs it (after any VAR=value and sudo), else None."""
    words = segment.split()
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("sudo", "exec", "time")):
        words.pop(0)
    if not words or not (PROGRAM.match(words[0]) or words[0] == "$NA"):
        return None
    out = []
    for w in words[1:]:
        if w.startswith(("<", "[", "{", "...", "$(")) or w in ("\\",):
            break  # placeholders and what follows them are not the command's own words
        out.append(w.strip("'\""))
    return out


def documented_commands() -> list[tuple[str, int, list[str]]]:
    """(page, line, words) of each `nodeagent ...` a page tells a person to run: in its shell blocks, and in inline
    code that begins with it."""
    found = []
    for page in pages():
        text = (ROOT / page).read_text(encoding="utf-8")
        block: str | None = None  # the open fence's info string
        pending = ""
        for n, line in enumerate(text.splitlines(), 1):
            fence = re.match(r"^ {0,3}(```|~~~)\s*(\S*)", line)
            if fence:
                block = None if block is not None else fence.group(2).lower()
                continue
            if block is not None:
                if block not in SHELL_INFO:
                    continue
                code = pending + line.split(" #")[0]
                if code.rstrip().endswith("\\"):  # a command continued on the next line
                    pending = code.rstrip()[:-1] + " "
                    continue
                pending = ""
                segments = re.split(r"&&|\|\||;|\||\$\(", code)
            else:
                segments = [span for span in re.findall(r"`([^`]+)`", line) if span.lstrip().startswith("nodeagent ")]
            for segment in segments:
                words = _command_words(segment)
                if words is None:
                    continue
                choice = next((i for i, w in enumerate(words) if "|" in w), None)
                if choice is None:  # `run extract|classify`: each of the alternatives
                    found.append((page, n, words))
                    continue
                for alternative in words[choice].replace("\\", "").split("|"):
                    found.append((page, n, [*words[:choice], alternative, *words[choice + 1:]]))
    return found


def resolve_command(words: list[str]):  # type: ignore[no-untyped-def]
    """The click command the words name (the deepest subcommand), and the words after its name."""
    import click

    from nodeagent.cli.main import cli

    cmd, rest = cli, list(words)
    while isinstance(cmd, click.Group) and rest and rest[0] in cmd.commands:
        cmd = cmd.commands[rest.pop(0)]
    return cmd, rest


def test_every_documented_command_and_flag_exists():
    """Each `nodeagent ...` a page shows names a real command (its --help runs), and each --flag it gives is one
    that command (or the top-level group) takes."""
    import click
    from click.testing import CliRunner

    from nodeagent.cli.main import cli

    commands = documented_commands()
    assert len(commands) > 80  # the tour, the fleet, operations, the install pages...
    top = {o for p in cli.params for o in (*p.opts, *p.secondary_opts)}
    bad, helped = [], set()
    runner = CliRunner()
    for page, line, words in commands:
        words = [w for w in words if w not in top or not w.startswith("--")]
        cmd, rest = resolve_command(words)
        path = " ".join(words[: len(words) - len(rest)])
        if isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
            bad.append(f"{page}:{line}: `nodeagent {' '.join(words)}`: no such command under `nodeagent {path}`")
            continue
        if path not in helped:
            got = runner.invoke(cli, [*path.split(), "--help"])
            assert got.exit_code == 0, (path, got.output)
            helped.add(path)
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | top | {"--help", "-h"}
        for flag in (w.split("=", 1)[0] for w in rest if w.startswith("--")):
            if flag not in known:
                bad.append(f"{page}:{line}: `nodeagent {path}` has no {flag}")
    assert not bad, "\n".join(bad)


def test_every_documented_variable_is_a_setting_or_read_by_the_project():
    """Each NODEAGENT_* a page names is a setting (as `nodeagent config show` lists them) or a variable the
    project's scripts, tests or benchmarks read."""
    import json
    import sys

    shown = subprocess.run([sys.executable, "-m", "nodeagent", "config", "show", "--json"], capture_output=True,
                           text=True, cwd=ROOT)
    settings = {v["env"] for v in json.loads(shown.stdout)["settings"].values()}
    scripts = "".join(p.read_text(errors="replace") for folder in ("scripts", "tests", "benchmarks")
                      for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in ("", ".py", ".sh"))
    bad = []
    for page in pages():
        for n, line in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"NODEAGENT_[A-Z0-9_]*[A-Z0-9]", line):
                if name not in settings and name not in scripts:
                    bad.append(f"{page}:{n}: {name} is neither a setting nor read by scripts/, tests/ or benchmarks/")
    assert len(settings) > 70 and not bad, "\n".join(bad)
