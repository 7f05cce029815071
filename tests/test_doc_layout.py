"""README's Layout block names every module of the packages it lists file by file, so a new user looking for where
something lives finds it there: configs/memory.py (the memory check before the build) was missing from it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# envs/ and sync/ are described by what they do, not module by module: only these are listed file by file.
LISTED = ("configs", "ppo", "dist")


def layout_block(readme: str) -> str:
    """The fenced block under `## Layout`."""
    section = readme.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def entries(block: str) -> dict[str, str]:
    """Each top-level entry (`name/` or `name.py` at column 0) with its indented continuation lines."""
    found: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            name = line.split()[0]
            found[name] = line[len(name):]
        elif name is not None:
            found[name] += "\n" + line
    return found


def unlisted(readme: str, root: Path) -> list[str]:
    """Modules under LISTED whose stem the Layout entry of their package does not name, and top-level scripts
    without an entry of their own."""
    listed = entries(layout_block(readme))
    missing = [path.name for path in sorted(root.glob("*.py")) if path.name not in listed]
    for package in LISTED:
        text = listed.get(f"{package}/", "")
        for path in sorted((root / package).glob("*.py")):
            if path.stem != "__init__" and not re.search(rf"\b{re.escape(path.stem)}\b", text):
                missing.append(f"{package}/{path.name}")
    return missing


def test_readme_layout_names_every_module():
    """Mutant: README's Layout without `memory.py (...)` in the configs/ entry (as before) -> fails naming
    configs/memory.py.
    Mutant: entries() keeping only an entry's first line -> fails naming the modules on continuation lines."""
    readme = (ROOT / "README.md").read_text()
    assert unlisted(readme, ROOT) == []


def test_a_module_named_only_in_another_entry_counts_as_missing(tmp_path):
    """A stem that occurs in another entry's text (dist/'s `checkpoint` in configs/' "which checkpoint") does not
    stand for the module.
    Mutant: unlisted() searching the whole block instead of the package's entry -> passes configs/checkpoint.py."""
    for name in ("configs/config.py", "configs/checkpoint.py", "ppo/loss.py", "dist/comm.py", "train.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    readme = ("# x\n\n## Layout\n\n```\ntrain.py     the loop\nconfigs/     config.py\nppo/         loss\n"
              "dist/        comm, checkpoint (atomic saves)\n```\n")
    assert unlisted(readme, tmp_path) == ["configs/checkpoint.py"]
