"""The README stays short and the docs stay connected: a page nobody links to, a link to a file or heading that
moved, or a command-line option no page documents is found here rather than by a reader. Text and the CLIs'
option tables only: no export, no server (the fast tier)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 120
CLI_PAGE = DOCS / "cli.md"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title"; the text may hold one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A command's section of docs/cli.md: "## `machgen-build lora add REPOSITORY ADAPTER_DIR`", its words lower case.
CLI_SECTION = re.compile(r"^## `(machgen[\w-]*(?: [a-z][\w-]*)*)[^`\n]*`\n(.*?)(?=^## |\Z)", re.M | re.S)


def pages() -> list[Path]:
    """The README, the docs, and the other Markdown a reader follows links from (model cards, the chart, results)."""
    others = [*ROOT.glob("models/*/README.md"), *ROOT.glob("deploy/**/*.md"), *ROOT.glob("perf/*.md"),
              ROOT / "model_repository" / "README.md"]
    return [README, *sorted(DOCS.glob("*.md")), *sorted(page for page in others if page.exists())]


def prose(text: str) -> str:
    """The text outside fenced code blocks and code spans, where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("//")


def anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose heading in a Markdown file, is not there."""
    broken = []
    for target in links(page.read_text()):
        if not relative(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no file {shown(resolved)})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {shown(resolved)})")
    return broken


def test_the_readme_is_short_enough_to_read_to_the_end():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, (f"README.md has {lines} lines (keep it under {README_MAX_LINES}): "
                                      "move reference text to a docs/ page")


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README.read_text()) if relative(target)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links: {broken_links(page)}"


def test_the_link_check_finds_what_is_broken(tmp_path):
    (tmp_path / "there.md").write_text("# A page\n\n## Its part: `code`\n\n## Its part: `code`\n")
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#its-part-code) [ok](there.md#its-part-code-1) ![ok](picture.png)\n"
        "[ok](https://example.com/missing.md) [ok](#a-heading)\n\n# A heading\n\n"
        "```sh\n[not a link](in-a-code-block.md)\n```\n`[not a link](in-a-span.md)`\n"
        "[gone](missing.md) [gone](there.md#no-such-part) ![gone](docs/picture.png) [gone](#nowhere)\n")
    assert [entry.split(" ")[0] for entry in broken_links(page)] == [
        "missing.md", "there.md#no-such-part", "docs/picture.png", "#nowhere"]


def cli_commands() -> dict[str, list[str]]:
    """Every command of ``machgen`` and ``machgen-build`` (walked from their Typer apps, subcommands of a group
    included) with every spelling of each of its options."""
    from typer.main import get_command

    from machgen.builder.cli import app as build_app
    from machgen.cli import app as serve_app

    def walk(command, words):
        if hasattr(command, "commands"):  # a group: `machgen-build lora`
            for name, sub in command.commands.items():
                yield from walk(sub, [*words, name])
        else:
            yield " ".join(words), [spelling for param in command.params if param.param_type_name == "option"
                                    for spelling in (*param.opts, *param.secondary_opts)]

    return {line: options for program, app in (("machgen", serve_app), ("machgen-build", build_app))
            for line, options in walk(get_command(app), [program])}


def undocumented_options(page: str, commands: dict[str, list[str]]) -> list[str]:
    """Each command with no section of ``page``, and each option its section does not name."""
    sections = {match[1]: match[2] for match in CLI_SECTION.finditer(page)}
    missing = []
    for line, options in commands.items():
        if line not in sections:
            missing.append(f"{line} (no section)")
            continue
        missing += [f"{line} {option}" for option in options
                    if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", sections[line])]
    return missing


def test_every_option_of_every_command_is_in_the_cli_page():
    commands = cli_commands()
    assert {"machgen serve", "machgen generate", "machgen-build build", "machgen-build lora add"} <= set(commands)
    assert not undocumented_options(CLI_PAGE.read_text(), commands), \
        f"docs/cli.md does not document: {undocumented_options(CLI_PAGE.read_text(), commands)}"


def test_the_option_check_finds_what_is_missing():
    commands = {"machgen serve": ["--host", "--progress", "--no-progress"], "machgen-build lora add": ["--name"]}
    page = ("## `machgen serve REPOSITORY`\n\n| `--host ADDRESS` | `--progress/--no-progress` |\n\n"
            "## `machgen-build lora add REPOSITORY ADAPTER_DIR`\n\n| `--name NAME` |\n")
    assert undocumented_options(page, commands) == []
    assert undocumented_options(page.replace("--host ADDRESS", "--hostname"), commands) == ["machgen serve --host"]
    assert undocumented_options(page.replace("lora add", "lora put"), commands) == [
        "machgen-build lora add (no section)"]
    # an option named only in another command's section is not documented for this one
    assert undocumented_options(page.replace("--name NAME", "").replace("--host ADDRESS", "--host --name"),
                                commands) == ["machgen-build lora add --name"]
