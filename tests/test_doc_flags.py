"""Every `--flag` that README.md and docs/*.md name is a flag that exists, so a renamed flag cannot leave the docs
teaching one the parser refuses.

Our flags are collected by introspection, with no process started: train.py's from the presets' `Config` objects,
named the way tyro names them (`--section.field-name`, a boolean's off switch `--section.no-field-name`, checked
against tyro itself below); each script's (bench/*.py, ppo/export.py, ppo/evaluate.py) from the argparse parser its
main() builds, caught at parse_args. A doc flag must be one of those, or an entry of ALLOWLIST (other tools' flags and
placeholders); a group mention (`--dist.*`, `--ppo.num-*`) must be the prefix of one of ours.
"""

import argparse
import copy
import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest
import tyro

from configs.presets import PRESETS
from tests.test_tools import load_bench

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")
SCRIPTS = ("bench/*.py", "ppo/export.py", "ppo/evaluate.py")     # files that build an argparse parser in main()

# Flags the docs name that are not ours: each with whose it is. Kept small: test_allowlist_is_small_and_hides_nothing
# fails on an entry that is one of our flags or that no doc names any more.
ALLOWLIST = {
    "--nproc-per-node": "torchrun",
    "--nnodes": "torchrun",
    "--standalone": "torchrun",
    "--max-restarts": "torchrun",
    "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun",
    "--rdzv-id": "torchrun",
    "--rdzv-conf": "torchrun",
    "--nodes": "sbatch (docs/running.md#slurm)",
    "--time": "sbatch (docs/running.md#slurm)",
    "--signal": "sbatch: slurm/train.sbatch's #SBATCH line; scancel (docs/running.md#slurm)",
    "--requeue": "sbatch: slurm/train.sbatch's #SBATCH line",
    "--no-requeue": "sbatch (docs/running.md#slurm)",
    "--open-mode": "sbatch: slurm/train.sbatch's #SBATCH line",
    "--samples_per_plugin": "tensorboard (docs/running.md: to show every Episode/return)",
    "--upgrade": "pip",
    "--extra-index-url": "pip",
    "--branch": "git clone",
    "--install": "Isaac Lab's isaaclab.sh",
    "--viz": "Isaac Lab's launcher (AppLauncher), passed in --env.launcher-args",
    "--kit_args": "Isaac Lab's launcher (AppLauncher), passed in --env.launcher-args",
    "--livestream": "Isaac Lab's launcher (AppLauncher), passed in --env.launcher-args",
    "--experience": "Isaac Lab's launcher (AppLauncher), passed in --env.launcher-args",
    "--deterministic": "Isaac Lab's launcher (AppLauncher), passed in --env.launcher-args",
    "--physics": "nobody's: the docs say Isaac Lab 3.0's launcher lacks it (envs/isaaclab.py refuses it)",
    "--the.flag": "placeholder in the docs' error format `error: --the.flag ...: what to do`",
    "--ppo.x": "placeholder: a checkpoint's field this version does not know (docs/fault_tolerance.md)",
}

# `--name`, `--section.name`, `--kit_args`; a group `--dist.*` or `--ppo.num-*` keeps its `.*`/`-*`. Not after a
# word character or a dash (`a--b`, `---`), and a sentence's full stop after a flag is not part of it.
FLAG = re.compile(r"(?<![\w-])--[A-Za-z](?:[\w.-]*[A-Za-z0-9])?(?:[.-]\*)?")


# ---- our flags ------------------------------------------------------------------------------------------------

def tyro_fields(cfg, prefix: str = "--") -> dict[str, tuple[tuple[str, ...], typing.Any]]:
    """Every flag tyro makes of the dataclass instance `cfg` -> (attribute path, value for the flag): a nested
    dataclass is a section (`--ppo.`), `_` is written `-`, and a boolean has the pair `--x` (True) / `--no-x`
    (False; `--section.no-x` inside a section). Walks the instance, so a preset's own fields count too."""
    flags = {}
    hints = typing.get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        value, name = getattr(cfg, field.name), field.name.replace("_", "-")
        if dataclasses.is_dataclass(value):
            for flag, (path, leaf) in tyro_fields(value, f"{prefix}{name}.").items():
                flags[flag] = ((field.name, *path), leaf)
        elif hints[field.name] is bool:
            flags[f"{prefix}{name}"] = ((field.name,), True)
            flags[f"{prefix}no-{name}"] = ((field.name,), False)
        else:
            flags[f"{prefix}{name}"] = ((field.name,), value)
    return flags


def train_flags() -> frozenset[str]:
    """train.py's flags: every preset's fields, and tyro's --help."""
    return frozenset().union(*(tyro_fields(make()) for make in PRESETS.values())) | {"--help"}


class _Parser(Exception):
    """Raised by parse_args in place of parsing: carries the parser main() built."""


def script_flags() -> dict[str, frozenset[str]]:
    """Each script's `--` flags (its argparse parser's option strings, --help included), by path."""
    found = {}
    for path in sorted(p for pattern in SCRIPTS for p in ROOT.glob(pattern)):
        if "ArgumentParser(" not in path.read_text():
            continue
        module = load_bench(path.stem, path.parent.name)

        def catch(parser, *args, **kwargs):
            raise _Parser(parser)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, "parse_args", catch)
            patch.setattr(sys, "argv", [str(path)])
            with pytest.raises(_Parser) as caught:
                module.main()
        parser = caught.value.args[0]
        found[str(path.relative_to(ROOT))] = frozenset(
            option for action in parser._actions for option in action.option_strings if option.startswith("--"))
    return found


class Ours(typing.NamedTuple):
    train: frozenset[str]       # train.py's, as tyro writes them (with dashes)
    scripts: frozenset[str]     # the scripts' together

    def has(self, flag: str) -> bool:
        """`flag` is one of ours; tyro reads `_` as `-` (`--ppo.num_epochs`), argparse does not."""
        return flag in self.scripts or "--" + flag[2:].replace("_", "-") in self.train

    def start(self, prefix: str) -> bool:
        return any(flag.startswith(prefix) for flag in self.train | self.scripts)


@pytest.fixture(scope="module")
def ours() -> Ours:
    scripts = script_flags()
    assert {"bench/bench_sync.py", "bench/bench_train.py", "ppo/export.py", "ppo/evaluate.py"} <= set(scripts), scripts
    return Ours(train_flags(), frozenset().union(*scripts.values()))


# ---- the docs' flags ----------------------------------------------------------------------------------------

def doc_texts() -> dict[str, str]:
    """The docs checked, by path relative to the repository root."""
    return {str(p.relative_to(ROOT)): p.read_text() for pattern in DOCS for p in sorted(ROOT.glob(pattern))}


def doc_flags(texts: dict[str, str]):
    """(file, line number, flag) for every flag mention in `texts`."""
    for name, text in texts.items():
        for number, line in enumerate(text.splitlines(), 1):
            for flag in FLAG.findall(line):
                yield name, number, flag


def doc_problems(texts: dict[str, str], ours: Ours, allowlist) -> list[str]:
    """One line per doc flag that is neither ours nor allowlisted, and per group that no flag of ours starts with."""
    problems = []
    for name, number, flag in doc_flags(texts):
        if flag.endswith("*"):
            prefix = flag[:-1]
            if not ours.start(prefix):
                problems.append(f"{name}:{number}: {flag} names a group of flags, but none of ours starts with "
                                f"{prefix}")
        elif not ours.has(flag) and flag not in allowlist:
            problems.append(f"{name}:{number}: {flag} is not a flag of train.py or of {' or '.join(SCRIPTS)}")
    return problems


def test_docs_name_only_flags_that_exist(ours):
    """Mutant: a doc naming --ppo.num-epoch (typo) -> fails naming README.md, the line and the flag.
    Mutant: tyro_fields without the `--no-` forms -> fails on README.md's --ppo.no-normalize-rewards.
    Mutant: a doc naming --ppo.* changed to --ppox.* -> fails: no flag of ours starts with --ppox.
    Mutant: docs/weight_sync.md naming bench_sync.py's --densities as --density -> fails.
    Mutant: tyro_fields keeping `_` in names (--ppo.num_epochs) -> fails on every hyphenated one, --ppo.num-epochs.
    Mutant: script_flags skipping bench/bench_mujoco.py -> fails on its --root, --tasks, --seeds.
    Mutant: PPOConfig.num_epochs renamed num_passes (presets too) -> fails on the docs' --ppo.num-epochs."""
    problems = doc_problems(doc_texts(), ours, ALLOWLIST)
    assert not problems, ("the docs name flags that do not exist; fix the doc, or if the flag is another tool's "
                          "(torchrun, pip, Isaac Lab, ...) add it to ALLOWLIST in tests/test_doc_flags.py with a "
                          "comment saying whose it is:\n" + "\n".join(problems))


def test_allowlist_is_small_and_hides_nothing(ours):
    """An allowlisted flag that is ours would hide it going stale; one no doc names any more only grows the list.
    Mutant: ALLOWLIST with --rollout.ranks added -> fails as ours. Mutant: ALLOWLIST with --nproc_per_node added
    -> fails as unused."""
    named = {flag for _, _, flag in doc_flags(doc_texts())}
    mine = sorted(flag for flag in ALLOWLIST if ours.has(flag))
    assert not mine, f"ALLOWLIST entries that are our own flags (they would hide one going stale): {mine}"
    unused = sorted(set(ALLOWLIST) - named)
    assert not unused, f"ALLOWLIST entries that no doc names any more: remove them: {unused}"


def test_tyro_accepts_every_derived_flag():
    """The flags derived above are what train.py's parser (tyro's overridable_config_cli over the presets) takes:
    every one, in one command line per preset, sets its field; a boolean's `--x` sets True and `--no-x` False, and
    underscores work as dashes (`--ppo.num_epochs`, as docs/fault_tolerance.md writes one).
    Mutant: tyro_fields writing the off switch --no-ppo.normalize-rewards -> tyro refuses the command line.
    Mutant: tyro_fields naming a section's flags without the section (`--num-epochs`) -> tyro refuses them."""
    configs = {name: (make.__doc__, make()) for name, make in PRESETS.items()}
    for preset, (_, cfg) in configs.items():
        fields = tyro_fields(cfg)
        for switch, spell in ((True, str), (False, lambda flag: "--" + flag[2:].replace("-", "_"))):
            argv, expected = [preset], copy.deepcopy(cfg)
            for flag, (path, value) in fields.items():
                if isinstance(value, bool):
                    if value != switch:
                        continue
                    argv.append(spell(flag))
                elif isinstance(value, tuple):
                    argv += [spell(flag), *map(str, value)]
                else:
                    argv += [spell(flag), str(value)]
                owner = expected
                for part in path[:-1]:
                    owner = getattr(owner, part)
                setattr(owner, path[-1], value)
            parsed = tyro.extras.overridable_config_cli(configs, args=argv, console_outputs=False)
            assert parsed == expected, (preset, argv)
