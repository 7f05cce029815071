"""Three of the project's written rules, checked statically (`ast`, no imports, well under a second) over its own
source (train.py, rollout_ranks.py, rollout_weights.py, configs/, dist/, ppo/, sync/, envs/; not tests/ or bench/):

- every function that communicates says in its docstring what crosses ranks, how often and why ("Crosses ranks:
  ..."), so a reader can account for every message and collective without running the job;
- every hyperparameter is a dataclass field with a one-line help string (the string literal under the field, which
  tyro prints for --help), so no flag reaches the command line unexplained;
- (over tests/ instead) every test that starts gloo ranks is marked `slow`, so `make test-fast` runs none.

What counts as communicating: a call of a torch.distributed collective or point-to-point function (`COLLECTIVES`),
or of a project function that makes one, resolved through the module's imports (`from dist import comm`,
`from dist.params import broadcast_module`, `self.method`) and iterated to a fixed point, so dist/comm.py's
wrappers are found the same way as their callers' callers. Not resolved (not checked): calls through an object that
is not `self` (`self.link.send_whole(...)`, `sync.recv(...)`), through a variable or a callback, and `.wait()` on a
posted operation. A nested def is accounted for by the function that defines it: its calls count as its owner's.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("train.py", "rollout_ranks.py", "rollout_weights.py", "configs", "dist", "ppo", "sync", "envs")

# torch.distributed functions that move data or wait for other ranks. init_process_group and new_group are in:
# both are entered by every rank and block until the others arrive (a store rendezvous / barrier), which is
# exactly what dist/setup.py's and dist/roles.py's docstrings already account for. Left out: queries and
# teardown that talk to no peer (get_rank, get_world_size, get_backend, is_initialized, destroy_process_group).
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "new_group", "new_subgroups", "init_process_group"})
TORCH_DIST = "torch.distributed"
SAYS_IT = ("crosses ranks", "cross ranks")     # matched case-insensitively, a line break counting as a space


def _source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class _Module:
    """One source file: its imported names (local name -> dotted target) and its functions by qualified name."""

    def __init__(self, path: Path):
        self.path, self.name = path, _module_name(path)
        self.tree = ast.parse(path.read_text(), filename=str(path))
        package = self.name if path.name == "__init__.py" else self.name.rpartition(".")[0]
        self.imports: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:                                        # `import torch.distributed` binds `torch`
                        self.imports[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                                   # `from . import comm`, `from .x import y`
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) + 1 - node.level] + ([node.module] if node.module else []))
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
        # qualified name ("f", "C.m") -> (def node, class name or None); nested defs are not listed
        self.functions: dict[str, tuple[ast.AST, str | None]] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = (node, None)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions[f"{node.name}.{item.name}"] = (item, node.name)

    def dotted(self, func: ast.expr, cls: str | None) -> str | None:
        """The call target as a dotted name ("torch.distributed.send", "dist.comm.all_reduce", "dist.setup.C.m"),
        or None when it goes through anything but a module, an imported name or `self`."""
        attrs = []
        while isinstance(func, ast.Attribute):
            attrs.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            return None
        if func.id == "self" and cls is not None:
            return f"{self.name}.{cls}.{'.'.join(reversed(attrs))}" if len(attrs) == 1 else None
        if func.id in self.imports:
            head = self.imports[func.id]
        elif not attrs and func.id in self.functions:
            head = f"{self.name}.{func.id}"
        else:
            return None
        return ".".join([head, *reversed(attrs)])

    def calls(self, node: ast.AST, cls: str | None) -> set[str]:
        """Dotted targets of every call in a function's body, its nested defs included (they act for it)."""
        return {target for sub in ast.walk(node) if isinstance(sub, ast.Call)
                for target in [self.dotted(sub.func, cls)] if target is not None}


def _torch_collective(target: str) -> bool:
    head, _, last = target.rpartition(".")
    return head == TORCH_DIST and last in COLLECTIVES


def communicating_functions() -> dict[str, tuple[Path, ast.AST]]:
    """"module.f" / "module.C.m" -> (file, def) for every function that communicates (see the module docstring)."""
    modules = [_Module(path) for path in _source_files()]
    calls = {f"{m.name}.{qual}": (m.path, node, m.calls(node, cls))
             for m in modules for qual, (node, cls) in m.functions.items()}
    talking = {name for name, (_, _, targets) in calls.items() if any(map(_torch_collective, targets))}
    while True:                                              # callers of communicating functions, to a fixed point
        more = {name for name, (_, _, targets) in calls.items() if name not in talking and targets & talking}
        if not more:
            return {name: calls[name][:2] for name in talking}
        talking |= more


def test_every_communicating_function_says_what_crosses_ranks():
    """The project's style rule: a function that communicates says in its docstring what crosses ranks, how often
    and why, in a sentence starting "Crosses ranks" (or "nothing crosses ranks"), so that a new collective or
    message cannot go in unaccounted for. This finds the functions and checks that the words are there; whether
    the sentence is right stays with the reader."""
    found = communicating_functions()
    assert len(found) > 30, f"the search found only {sorted(found)}: it no longer sees the project's collectives"
    def says_it(node: ast.AST) -> bool:
        words = " ".join((ast.get_docstring(node) or "").lower().split())
        return any(phrase in words for phrase in SAYS_IT)
    silent = sorted(f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                    for name, (path, node) in found.items() if not says_it(node))
    assert not silent, "these functions communicate but their docstrings do not say what crosses ranks:\n" + \
        "\n".join(silent)


def _dataclasses(tree: ast.Module) -> list[ast.ClassDef]:
    """The module's classes decorated `@dataclass` or `@dataclass(...)`."""
    def is_dataclass(decorator: ast.expr) -> bool:
        name = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(name, ast.Name) and name.id == "dataclass"
    return [node for node in tree.body
            if isinstance(node, ast.ClassDef) and any(map(is_dataclass, node.decorator_list))]


def test_every_config_field_has_a_one_line_help_string():
    """The rule in configs/config.py: every hyperparameter is a dataclass field with a one-line help string, the
    string literal right under it that tyro prints for --help. A field that holds another dataclass of the file
    (Config.env, Config.ppo, ...) is a group of flags, not a hyperparameter: its own fields carry the help."""
    path = ROOT / "configs" / "config.py"
    classes = _dataclasses(ast.parse(path.read_text(), filename=str(path)))
    groups = {node.name for node in classes}
    fields, missing = 0, []
    for node in classes:
        for field, after in zip(node.body, node.body[1:] + [None]):
            if not isinstance(field, ast.AnnAssign) or not isinstance(field.target, ast.Name):
                continue
            if isinstance(field.annotation, ast.Name) and field.annotation.id in groups:
                continue
            fields += 1
            help_ = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                          and isinstance(after.value.value, str)) else None
            if help_ is None or not help_.strip() or "\n" in help_.strip():
                why = ("no help string" if help_ is None else "empty help string" if not help_.strip() else
                       "help string is not one line")
                missing.append(f"{path.relative_to(ROOT)}:{field.lineno}: {node.name}.{field.target.id} ({why})")
    assert fields > 50, f"only {fields} fields found in {len(classes)} dataclasses: the search no longer sees them"
    assert not missing, "these config fields have no one-line help for --help:\n" + "\n".join(missing)


def _starts_ranks(functions: dict[str, ast.FunctionDef], name: str, seen: frozenset = frozenset()) -> bool:
    """Whether `name` calls tests.multirank.run_ranks, itself or through another function of its file."""
    calls = {node.func.id for node in ast.walk(functions[name])
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    return "run_ranks" in calls or any(_starts_ranks(functions, other, seen | {name})
                                       for other in calls & functions.keys() - seen - {name})


def test_every_test_that_starts_ranks_is_marked_slow():
    """README and the Makefile: `make test-fast` skips the tests marked `slow`, the multi-rank ones among them. A
    test that forks gloo ranks (run_ranks, directly or through a helper of its file) without the mark ran there."""
    unmarked, multirank = [], 0
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        for name, node in functions.items():
            if not name.startswith("test") or not _starts_ranks(functions, name):
                continue
            multirank += 1
            marks = [ast.unparse(decorator) for decorator in node.decorator_list]
            if "pytest.mark.slow" not in marks:
                unmarked.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert multirank > 20, f"only {multirank} multi-rank tests found: the search no longer sees run_ranks"
    assert not unmarked, "these tests start gloo ranks but are not marked slow:\n" + "\n".join(unmarked)
