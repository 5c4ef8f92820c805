"""The operator's page's vendored files (nodeagent/ui/static/vendor/): each is the one its MANIFEST.json names,
byte for byte (sha256), from the npm tarball it names, with its licence beside it; nothing is there that the
manifest does not name; none loads anything from another origin; and pyproject.toml ships them in the wheel."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "nodeagent" / "ui" / "static" / "vendor"
MANIFEST = VENDOR / "MANIFEST.json"
FIELDS = {"file", "package", "version", "source", "path_in_package", "license", "license_file", "sha256"}
SPDX = {"0BSD", "MIT"}  # the licences vendored today: another one is a decision to make, not a file to drop in

# An absolute or protocol-relative URL (https://host, //host.tld): what a script or stylesheet would fetch from.
URL = re.compile(r"(?:https?:)?//[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+[^\s\"'`)]*")
# The only URLs in the vendored files: uPlot's banner comment, at the top, names its repository. A new one (a
# re-vendored release) fails here until someone has read it and said why it is harmless.
BANNERS = {"uPlot.iife.min.js": re.compile(r"/\*! https://github\.com/leeoniya/uPlot \(v[0-9.]+\) \*/")}
CDNS = ("unpkg", "jsdelivr", "cdnjs", "cdn.", "googleapis", "gstatic", "cloudflare")


def manifest() -> list[dict]:
    return json.loads(MANIFEST.read_text())


def licence_files() -> set[str]:
    return {e["license_file"] for e in manifest()}


def test_the_manifest_names_each_file_with_its_source_licence_and_checksum():
    entries = manifest()
    assert entries, "an empty manifest"
    for e in entries:
        assert set(e) == FIELDS, e
        assert e["source"] == f"https://registry.npmjs.org/{e['package']}/-/{e['package']}-{e['version']}.tgz"
        assert e["license"] in SPDX, e
        assert re.fullmatch(r"[0-9a-f]{64}", e["sha256"]), e
    assert len({e["file"] for e in entries}) == len(entries)
    by_package = {e["package"]: e["version"] for e in entries}
    assert by_package["htmx.org"].startswith("2.") and by_package["htmx-ext-sse"].startswith("2.")
    assert by_package["uplot"].startswith("1.6.")


@pytest.mark.parametrize("entry", manifest(), ids=lambda e: e["file"])
def test_each_vendored_file_is_the_one_the_manifest_names(entry):
    path = VENDOR / entry["file"]
    assert path.is_file(), f"{entry['file']} is missing"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], f"{entry['file']} was changed"


def test_every_file_in_the_folder_is_in_the_manifest():
    listed = {e["file"] for e in manifest()} | licence_files() | {MANIFEST.name}
    present = {p.relative_to(VENDOR).as_posix() for p in VENDOR.rglob("*") if p.is_file()}
    assert present - listed == set(), f"not in MANIFEST.json: {sorted(present - listed)}"


def test_each_licence_is_beside_its_files():
    for name in licence_files():
        text = (VENDOR / name).read_text()
        assert len(text.strip()) > 100, f"{name} is empty"
        assert "Permission" in text, f"{name} does not read as a licence grant"


@pytest.mark.parametrize("entry", manifest(), ids=lambda e: e["file"])
def test_no_vendored_file_loads_from_another_origin(entry):
    """The page is served by the node itself, often with no internet: a URL a script would fetch, a script or
    stylesheet loaded from a CDN, or a CSS @import or url() of another origin would break it (or leak the
    operator's visit). The minified files are searched as they are (a comment cannot be told from a string or
    a regular expression reliably there): a URL is allowed only inside the file's banner comment (BANNERS)."""
    text = (VENDOR / entry["file"]).read_text()
    banner = BANNERS.get(entry["file"])
    head = banner.match(text) if banner else None
    assert banner is None or head, f"{entry['file']} does not begin with its banner comment"
    allowed_up_to = head.end() if head else 0
    assert [m.group() for m in URL.finditer(text) if m.end() > allowed_up_to] == []
    lowered = text.lower()
    assert not [c for c in CDNS if c in lowered], f"{entry['file']} names a CDN"
    if entry["file"].endswith(".css"):
        assert "@import" not in text and "url(" not in text  # no fonts or images fetched by the stylesheet


def test_the_url_check_finds_a_cdn_load():
    """The searches above are not vacuous: they catch the loads they are there for."""
    assert URL.findall('s.src="https://unpkg.com/htmx.org@2.0.11"') == ["https://unpkg.com/htmx.org@2.0.11"]
    assert URL.findall("import'//cdn.jsdelivr.net/npm/uplot'") == ["//cdn.jsdelivr.net/npm/uplot"]
    assert URL.findall('const Ot=(new XPathEvaluator).createExpression(".//*[@*")') == []  # htmx's XPath


def test_pyproject_ships_the_static_files_in_the_wheel():
    """Without building a wheel (tests/test_wheel.py does): the package-data patterns of nodeagent.ui match every
    file under nodeagent/ui/static/, and nodeagent.ui is a listed package."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "nodeagent.ui" in tool["packages"]
    patterns = tool["package-data"]["nodeagent.ui"]
    assert "templates/**/*" in patterns
    ui = ROOT / "nodeagent" / "ui"
    shipped = {p for pattern in patterns for p in ui.glob(pattern) if p.is_file()}
    files = {p for p in (ui / "static").rglob("*") if p.is_file()}
    assert files and files <= shipped, sorted(str(p.relative_to(ui)) for p in files - shipped)
