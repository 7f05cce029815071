"""docs/design.md's "Adding an env of your own" is the recipe a researcher follows literally: every file of the
code that names the envs one by one (a registry an env of your own must join) is named there, so a list added later
cannot be missed by the next researcher. Read off the code, not a list kept here."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ("tests", "bench", ".venv", "runs")     # tests are the recipe's own paragraph; benches pick their envs


def adding_an_env_section() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    return re.search(r"^## Adding an env of your own\n(.*?)(?=^## )", text, re.S | re.M).group(1)


def files_naming_an_env(root: Path = ROOT) -> list[str]:
    """The source files with "cartpole" as a string of their code (not a comment or docstring's word)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in SKIPPED:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Constant) and node.value == "cartpole" for node in ast.walk(tree)):
            found.append(str(path.relative_to(root)))
    return found


def test_the_recipe_names_every_file_that_lists_the_envs():
    """configs/memory.py's EMBEDDED (the memory check of an embedded env's rollout storage before the build) was in
    no step: an env left out of it is built unchecked, and a --env.num-envs too large for the machine is killed by
    the kernel with no message. Mutant: design.md without its configs/memory.py sentence."""
    files = files_naming_an_env()
    assert {"envs/__init__.py", "configs/config.py", "configs/presets.py"} <= set(files), files   # the scan works
    section = adding_an_env_section()
    assert [f for f in files if f"`{f}`" not in section] == []
    assert "`Makefile`" in section and "PRESETS :=" in (ROOT / "Makefile").read_text()
