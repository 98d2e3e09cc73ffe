"""The manual cannot rot: every shell block of README.md and docs/*.md is checked against the code.

A fenced ``sh`` / ``bash`` / ``shell`` block is either marked on the line before its fence with
``<!-- doc-test: skip (reason) -->`` (a GPU, a long-running server, minutes of work, a tool outside
this repository), or every command in it is checked without running it: ``nemospec SUB`` names a
real subcommand, ``python -m MODULE`` a real module, ``python SCRIPT`` a file of this repository,
``make TARGET`` a Makefile target, and every ``--flag`` is one the command's own argparse parser
defines. The parsers are the real objects: one subprocess runs each command as ``__main__`` with
``--help`` and ``ArgumentParser.parse_args`` replaced by a hook that hands the parser back before
anything else happens (``_collect``, below). Also checked: the README's length, its bench block
against docs/bench/report.json, relative links, no dates and no paths of one machine in the text.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELL_LANGS = ("sh", "bash", "shell")
SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*$")
FLAG = re.compile(r"^[\[(]*(--[A-Za-z0-9][A-Za-z0-9_-]*)")
PYTHONS = {"python", "python3", ".venv/bin/python", "$(BIN)/python"}
# tools that are not ours but harmless in a checked block (nothing of theirs is verified)
PLAIN = {"cd", "export", "echo", "cat", "ls", "mkdir", "grep", "head", "tail"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int              # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None       # the reason of a skip marker, None when unmarked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(text: str, path: Path = README) -> list[Block]:
    """Every fenced block (any language) with the skip marker of the line before its fence."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(2), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        marker = SKIP.match(lines[start - 1].strip()) if start else None
        out.append(Block(path, start + 1, lang, "\n".join(body), marker.group("reason").strip() if marker else None))
        i += 1
    return out


def shell_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p.read_text(), p) if b.lang in SHELL_LANGS]


def commands(text: str) -> list[list[str]]:
    """The simple commands of a block: continuation lines joined, comments dropped, split at
    ``&&``, ``|``, ``;``, ``&`` outside a synopsis's brackets (``[--a X | --b]`` stays whole)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise ValueError(f"cannot split {line!r}: {e}") from None
        depth, current = 0, []
        for tok in tokens:
            if depth <= 0 and tok in SEPARATORS:
                out.append(current)
                current = []
                continue
            depth += tok.count("[") + tok.count("(") - tok.count("]") - tok.count(")")
            current.append(tok)
        out.append(current)
    return [c for c in out if c]


def _flags(args: list[str]) -> list[str]:
    found = []
    for tok in args:
        m = FLAG.match(tok)
        if m:
            found.append(m.group(1).split("=")[0])
    return found


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def target_of(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    """(what to ask for options, the arguments after it, an error): ``cli:SUB``, ``module:NAME``,
    ``script:PATH``, ``make`` or a plain tool (None)."""
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if not argv:
        return None, [], None
    prog, rest = argv[0], argv[1:]
    if prog in ("nemospec", "nemospec-build"):
        if prog == "nemospec-build":
            return "cli:build", rest, None
        if not rest or rest[0].startswith("-"):
            return "cli:", rest, None
        return f"cli:{rest[0]}", rest[1:], None
    if prog in PYTHONS:
        if rest[:1] == ["-m"] and len(rest) > 1:
            if rest[1] == "nemospec.cli":
                return target_of(["nemospec", *rest[2:]])
            return f"module:{rest[1]}", rest[2:], None
        if rest and rest[0].endswith(".py"):
            if not (ROOT / rest[0]).is_file():
                return None, [], f"{rest[0]}: no such script in this repository"
            return f"script:{rest[0]}", rest[1:], None
        return None, [], f"{' '.join(argv)}: expected `python -m MODULE` or `python SCRIPT.py`"
    if prog == "make":
        return "make", rest, None
    if prog in PLAIN:
        return None, [], None
    return None, [], (f"{prog}: not a command this test can check; mark the block "
                      "`<!-- doc-test: skip (reason) -->`")


def check_text(text: str, options) -> list[str]:
    """The problems of one unmarked shell block; ``options(target)`` gives a command's option strings
    (a set), or a string saying why there are none."""
    problems = []
    try:
        cmds = commands(text)
    except ValueError as e:
        return [str(e)]
    for argv in cmds:
        target, args, error = target_of(argv)
        if error:
            problems.append(error)
            continue
        if target is None:
            continue
        if target == "make":
            targets = _make_targets()
            for a in args:
                if a.startswith("-") or "=" in a:
                    continue
                if a not in targets:
                    problems.append(f"make {a}: no such Makefile target (have {', '.join(sorted(targets))})")
            continue
        known = options(target)
        if isinstance(known, str):
            problems.append(f"{' '.join(argv[:3])}: {known}")
            continue
        for flag in _flags(args):
            if flag not in known:
                problems.append(f"{' '.join(argv[:3])}: {flag} is not a flag of {target} "
                                f"(its parser: {', '.join(sorted(f for f in known if f.startswith('--')))})")
    return problems


# --- the parsers, collected in one subprocess -------------------------------------------------------
def _collect(targets: list[str]) -> dict:
    """Runs in the subprocess: each module or script as ``__main__`` with ``--help``, its parser taken
    at its first parse_args (nothing after that runs)."""
    import argparse
    import importlib.util
    import runpy

    class Captured(BaseException):
        def __init__(self, parser):
            self.parser = parser

    def hook(self, *args, **kwargs):
        raise Captured(self)

    def no_exec(*args, **kwargs):
        raise RuntimeError("re-exec refused while collecting parsers")

    for name in ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"):
        if hasattr(argparse.ArgumentParser, name):
            setattr(argparse.ArgumentParser, name, hook)
    for name in ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe"):
        setattr(os, name, no_exec)

    def options(parser) -> dict:
        own = sorted(s for a in parser._actions for s in a.option_strings)
        subs = {}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                subs = {n: sorted(s for x in p._actions for s in x.option_strings) for n, p in a.choices.items()}
        return {"options": own, "subcommands": subs}

    out = {}
    for target in targets:
        kind, name = target.split(":", 1)
        try:
            if kind == "module":
                spec = importlib.util.find_spec(name)
                if spec is None or spec.origin is None:
                    out[target] = {"error": f"no module {name}"}
                    continue
                source = Path(spec.origin).read_text()
            else:
                source = (ROOT / name).read_text()
            if "ArgumentParser" not in source:
                out[target] = {"options": [], "subcommands": {}, "note": "no argparse parser"}
                continue
            sys.argv = [name, "--help"]
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, str((ROOT / name).parent))
                runpy.run_path(str(ROOT / name), run_name="__main__")
            out[target] = {"error": "ran without parsing its arguments"}
        except Captured as c:
            out[target] = options(c.parser)
        except BaseException as e:  # noqa: BLE001 - reported, not raised: one target's failure names it
            out[target] = {"error": f"{type(e).__name__}: {e}"}
    return out


@functools.lru_cache(maxsize=None)
def _parsers(targets: tuple[str, ...]) -> dict:
    env = {**os.environ, "NEMOSPEC_MALLOC": "system", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--collect", *targets], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"collecting parsers failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def _targets_of(texts) -> tuple[str, ...]:
    wanted = set()
    for text in texts:
        for argv in commands(text):
            target, _, error = target_of(argv)
            if target and not error and target != "make":
                wanted.add("module:nemospec.cli" if target.startswith("cli:") else target)
    return tuple(sorted(wanted))


def options_from(parsers: dict):
    def options(target: str):
        if target.startswith("cli:"):
            cli = parsers.get("module:nemospec.cli", {})
            if "error" in cli:
                return cli["error"]
            sub = target[4:]
            if not sub:
                return set(cli["options"])
            if sub not in cli["subcommands"]:
                return f"no such subcommand {sub!r} (have {', '.join(sorted(cli['subcommands']))})"
            return set(cli["subcommands"][sub])
        entry = parsers.get(target)
        if entry is None:
            return "not collected"
        if "error" in entry:
            return entry["error"]
        return set(entry["options"])
    return options


# --- the tests --------------------------------------------------------------------------------------
SELF_CHECK = """\
nemospec build --output_dir build/x --speculative_decoding_mode eagle3 --no_such_flag_at_all
nemospec frobnicate --output_dir x
python -m builder.no_such_module --x
python benchmarks/no_such_script.py
make no_such_target
curl localhost:8000/v2/health/ready
"""
VALID = """\
MODE=dflash make demo
nemospec build [--checkpoint_dir CKPT] --output_dir E \\
    [--dtype auto|float32] [--speculative_decoding_mode M | --strip_plan]  # a synopsis
.venv/bin/python benchmarks/soak.py --minutes 10 && python -m builder.random_checkpoint --help
"""


def test_checker_rejects_what_is_not_there():
    """A checker that cannot fail is no check: each made-up name below must be refused."""
    parsers = _parsers(_targets_of([SELF_CHECK, VALID, *(b.text for b in shell_blocks())]))
    problems = check_text(SELF_CHECK, options_from(parsers))
    text = "\n".join(problems)
    for expected in ("--no_such_flag_at_all", "frobnicate", "builder.no_such_module", "no_such_script.py",
                     "no_such_target", "curl"):
        assert expected in text, f"the checker let {expected} through:\n{text}"
    assert check_text(VALID, options_from(parsers)) == []


def test_commands_split_like_a_shell_outside_synopses():
    assert commands("a --x 1 && b | c # d\nmake test") == [["a", "--x", "1"], ["b"], ["c"], ["make", "test"]]
    assert commands("nemospec serve [--openai_port 9000 | --no_openai] \\\n  --host h") == [
        ["nemospec", "serve", "[--openai_port", "9000", "|", "--no_openai]", "--host", "h"]]


def test_skip_marker_is_read_from_the_line_before_the_fence():
    text = "x\n<!-- doc-test: skip (needs a GPU) -->\n```sh\nnemospec serve\n```\n```sh\nmake test\n```\n"
    found = blocks(text)
    assert [(b.line, b.skip) for b in found] == [(3, "needs a GPU"), (6, None)]


def test_every_shell_block_is_checked_or_marked():
    found = shell_blocks()
    assert len(found) >= 10, "expected the README and docs/ to show commands"
    parsers = _parsers(_targets_of([SELF_CHECK, VALID, *(b.text for b in found)]))
    options = options_from(parsers)
    failures = []
    for b in found:
        if b.skip is not None:
            if len(b.skip.split()) < 2:
                failures.append(f"{b.where}: a skip marker must say why (e.g. 'needs a GPU'), got {b.skip!r}")
            continue
        failures += [f"{b.where}: {p}" for p in dict.fromkeys(check_text(b.text, options))]
    assert not failures, "\n".join(failures)


def test_no_stray_skip_markers_and_no_untagged_commands():
    failures = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if SKIP.match(line.strip()) and not (i + 1 < len(lines) and re.match(r"^\s*```(sh|bash|shell)\s*$", lines[i + 1])):
                failures.append(f"{path.relative_to(ROOT)}:{i + 1}: a skip marker not followed by a sh block")
            if line.strip().startswith("<!--") and "doc-test" in line and not SKIP.match(line.strip()):
                failures.append(f"{path.relative_to(ROOT)}:{i + 1}: malformed marker {line.strip()!r}")
        for b in blocks(path.read_text(), path):
            first = b.text.strip().split(maxsplit=1)[:1]
            if b.lang == "" and first and first[0] in {"nemospec", "make", "python", "python3", ".venv/bin/python",
                                                     "curl", "docker"}:
                failures.append(f"{b.where}: a command in an untagged block; tag it ```sh")
    assert not failures, "\n".join(failures)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines (at most 300: the rest belongs in docs/)"


def test_readme_bench_block_is_rendered_from_the_committed_report():
    from nemospec.bench_report import readme_block, readme_table
    report = json.loads((ROOT / "docs/bench/report.json").read_text())
    assert readme_block(README.read_text()) == readme_table(report), (
        "README.md's bench block differs from docs/bench/report.json: run `python -m nemospec.bench_report --readme`")


def test_readme_block_helpers_round_trip(tmp_path):
    from nemospec.bench_report import README_BEGIN, README_END, readme_block, readme_table, update_readme
    report = json.loads((ROOT / "docs/bench/report.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nstale, hand-edited\n{README_END}\n\ntail\n")
    assert update_readme(readme, report) is True
    assert readme_block(readme.read_text()) == readme_table(report)
    assert readme.read_text().endswith(f"{README_END}\n\ntail\n")
    assert update_readme(readme, report) is False
    with pytest.raises(ValueError):
        readme_block("no markers here")


def _prose(path: Path) -> str:
    text = path.read_text()
    if path == README:
        from nemospec.bench_report import README_BEGIN, README_END
        start, end = text.find(README_BEGIN), text.find(README_END)
        if 0 <= start < end:
            text = text[:start] + text[end:]
    return text


def test_no_dated_narrative_and_no_machine_paths():
    failures = []
    for path in doc_files():
        for i, line in enumerate(_prose(path).splitlines(), 1):
            if re.search(r"\b20\d\d-\d\d-\d\d\b", line):
                failures.append(f"{path.relative_to(ROOT)}:{i}: a date (history is git's): {line.strip()[:80]}")
            if re.search(r"(?<![\w.$])/(work|root|tmp|home|Users)/", line):
                failures.append(f"{path.relative_to(ROOT)}:{i}: a path of one machine: {line.strip()[:80]}")
    assert not failures, "\n".join(failures)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if re.match(r"^\s*```", line):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    failures = []
    for path in doc_files():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            dest = (path.parent / target) if target else path
            if not dest.exists():
                failures.append(f"{path.relative_to(ROOT)}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                failures.append(f"{path.relative_to(ROOT)}: link to {target}#{anchor}: no such heading")
    assert not failures, "\n".join(failures)


if __name__ == "__main__" and sys.argv[1:2] == ["--collect"]:
    sys.path.insert(0, str(ROOT))
    result = _collect(sys.argv[2:])
    sys.stdout.flush()
    print(json.dumps(result))
