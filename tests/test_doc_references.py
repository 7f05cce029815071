"""What README.md and docs/*.md point at exists: every repository path they name (`ppo/loss.py`, `bench/`), every
function named by its module's path (`tests/test_sync_common.converted`), every test named as
`tests/test_x.py::test_name` or alone in backticks, every `make target`, and every markdown link's file and `#anchor`
(GitHub's heading slugs). A renamed file, test, target or heading cannot leave a doc pointing at nothing; flags are
tests/test_doc_flags.py's, README's Layout block tests/test_doc_layout.py's."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/*.md")
# A path under one of the repository's folders: a file with an extension or a folder with its `/` (`envs/rank` in
# "512 envs/rank" is neither). A segment in capitals (`envs/NAME.py`) is a placeholder; `*` must match something.
PATH = re.compile(r"(?<![\w./-])(?:bench|configs|dist|docs|envs|ppo|sync|tests)/"
                  r"(?:[\w*-]+/)*(?:[\w*-]+\.\w+|(?=[\s`)]))")
TEST = re.compile(r"(tests/\w+\.py)::\s*(\w+)")   # the name may start the next line
BARE = re.compile(r"`(test_\w+)`")                 # a test named alone: some tests/*.py defines it
MAKE = re.compile(r"`make ([a-z][\w-]*)")
EXTENSIONS = {"py", "md", "sh", "txt", "toml", "json", "csv"}    # else `module.symbol`
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_texts(root: Path = ROOT) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for pattern in DOCS for p in sorted(root.glob(pattern))}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, only letters, digits, `_`, `-` and spaces kept, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside fenced blocks); a repeated slug gets `-1`, `-2`, ..."""
    found, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*?)\s*#*$", line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def problems(texts: dict[str, str], root: Path = ROOT) -> list[str]:
    """One line per path, test, make target, link or anchor that a doc names and the tree does not have."""
    targets = set(re.findall(r"^([a-z][\w-]*):", (root / "Makefile").read_text(), re.M))
    tests = "\n".join(path.read_text() for path in sorted((root / "tests").glob("*.py")))
    found = []
    for name, text in texts.items():
        for match in TEST.finditer(text):
            path, test = match.groups()
            where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}:"
            if (root / path).exists() and not re.search(rf"^\s*def {test}\(", (root / path).read_text(), re.M):
                found.append(f"{where} {path} has no test {test}")
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{name}:{number}:"
            for path in PATH.findall(LINK.sub("]", line)):     # a link's target is checked below
                if re.search(r"/[A-Z]+[./]", "/" + path):
                    continue
                module, _, symbol = path.rpartition(".")
                if module and "/" not in symbol and symbol not in EXTENSIONS:     # `tests/test_sync_common.converted`
                    source = root / f"{module}.py"
                    if not source.exists() or not re.search(rf"^(def|class) {symbol}\b|^{symbol} =",
                                                             source.read_text(), re.M):
                        found.append(f"{where} {path}: no {symbol} at the top of {module}.py")
                elif not (list(root.glob(path)) if "*" in path else (root / path).exists()):
                    found.append(f"{where} {path} does not exist")
            for test in BARE.findall(line):
                if not re.search(rf"^\s*def {test}\(", tests, re.M):
                    found.append(f"{where} no tests/*.py defines {test}")
            for target in MAKE.findall(line):
                if target not in targets:
                    found.append(f"{where} `make {target}`: the Makefile has no target {target}")
            for link in LINK.findall(line):
                if re.match(r"[a-z]+:", link):
                    continue
                file, _, anchor = link.partition("#")
                target = (root / name).parent / file if file else root / name
                if not target.exists():
                    found.append(f"{where} link {link}: no file {file}")
                elif anchor and anchor not in anchors(target.read_text()):
                    found.append(f"{where} link {link}: {file or name} has no heading with anchor #{anchor}")
    return found


def test_docs_point_only_at_what_exists():
    """Mutant: docs/running.md's `## Make variables` renamed `## Make settings` -> fails on README's
    docs/running.md#make-variables link.
    Mutant: a doc naming `bench/bench_sync.py` as `bench/bench_weights.py` -> fails naming the doc and line.
    Mutant: README naming `make test-quick` -> fails: the Makefile has no such target.
    Mutant: docs/gpu.md's `tests/test_sync_common.converted` as `.convert` -> fails: no such function there.
    Mutant: docs/gpu.md's test_a_replay_refuses_a_minibatch_... (after a `::` line break) misspelled -> fails."""
    found = problems(doc_texts())
    assert not found, "the docs point at things that do not exist:\n" + "\n".join(found)


def test_slugs_and_catches(tmp_path):
    """The checker itself on a small tree: GitHub's slugs (punctuation dropped, repeats numbered, fenced `#` lines
    are not headings), and each kind of broken reference caught once.
    Mutant: slug() keeping punctuation -> `resuming:-the-rules` misses. Mutant: anchors() reading fenced lines ->
    the fenced `# not a heading` resolves. Mutant: TEST without `\\s*` after `::` -> test_two is not caught."""
    text = "# A\n## Resuming: the rules\n## Measured (`make bench`)\n## A\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a", "resuming-the-rules", "measured-make-bench", "a-1"}
    (tmp_path / "docs").mkdir()
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo/loss.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_x.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "Makefile").write_text("test:  ## x\n\ttrue\n")
    (tmp_path / "docs/a.md").write_text(text)
    doc = ("`ppo/loss.py` `ppo/gone.py` `envs/NAME.py` 512 envs/rank `ppo/*.py` `dist/*.py`\n"
           "tests/test_x.test_one tests/test_x.gone\n"
           "tests/test_x.py::test_one tests/test_x.py::\n  test_two `make test` `make tset` `test_one` `test_three`\n"
           "[a](docs/a.md#resuming-the-rules) [b](docs/a.md#not-a-heading) [c](docs/b.md) [d](https://x.org/#y)\n")
    assert [line.split(":", 2)[2] for line in problems({"README.md": doc}, tmp_path)] == [
        " tests/test_x.py has no test test_two", " ppo/gone.py does not exist", " dist/*.py does not exist",
        " tests/test_x.gone: no gone at the top of tests/test_x.py",
        " no tests/*.py defines test_three", " `make tset`: the Makefile has no target tset",
        " link docs/a.md#not-a-heading: docs/a.md has no heading with anchor #not-a-heading",
        " link docs/b.md: no file docs/b.md"]
