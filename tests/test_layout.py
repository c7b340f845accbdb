"""The package's layout: modules with one job each and no import cycle (issue 24).

Read from the source with ``ast``, nothing imported. Every module of ``mpjax`` holds:

- no import cycle among mpjax modules (imports inside functions and under
  ``TYPE_CHECKING`` count: a lazy import that dodges a cycle is still one);
- at most 700 lines per module and 120 lines per function;
- no leading-underscore name of one mpjax module used by another (``from
  mpjax.x import _y``, ``import mpjax.x as m; m._y``, ``mpjax.x._y``); scripts/
  is held to this too. Private modules (``mpjax._dtypes``) with public names are fine;
- ``jax._src`` imported only in ``mpjax/jax_compat.py``.

What still breaks a rule is listed below, each entry with its reason. An entry
that no longer breaks its rule fails the test too: remove it once its module is fixed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpjax"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 120

# Modules still to split.
LONG_MODULES_ALLOWED: set[str] = set()
# Functions still to split: (file, qualified name).
LONG_FUNCTIONS_ALLOWED: set[tuple[str, str]] = set()
# Underscore names still used across modules: (importing file, "module.name").
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(), filename=str(path))


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
  """The absolute name of ``from <level dots><module> import ...`` in ``importer``."""
  if not level:
    return module or ""
  base = importer.split(".")
  base = base[: len(base) - level + (1 if is_package else 0)]
  return ".".join([*base, module] if module else base)


def _imports(path: pathlib.Path) -> list[tuple[str, str | None, str | None, int]]:
  """Each import of the file: (module, imported name or None, bound alias, line)."""
  name = _module_name(path) if path.is_relative_to(PACKAGE) else path.stem
  out = []
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Import):
      for a in node.names:
        out.append((a.name, None, a.asname, node.lineno))
    elif isinstance(node, ast.ImportFrom):
      module = _resolve(node.module, node.level, name, path.name == "__init__.py")
      for a in node.names:
        out.append((module, a.name, a.asname or a.name, node.lineno))
  return out


def _target(module: str, name: str | None) -> str | None:
  """The mpjax module an import loads: ``from mpjax import data`` loads ``mpjax.data``."""
  if name is not None and f"{module}.{name}" in MODULES:
    return f"{module}.{name}"
  return module if module in MODULES else None


def import_graph() -> dict[str, set[str]]:
  """mpjax module -> the mpjax modules it imports."""
  graph: dict[str, set[str]] = {m: set() for m in MODULES}
  for importer, path in MODULES.items():
    for module, name, _, _ in _imports(path):
      target = _target(module, name)
      if target is not None and target != importer:
        graph[importer].add(target)
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def _long_functions(path: pathlib.Path) -> dict[tuple[str, str], int]:
  """(file, qualified name) -> lines, for each function over the limit."""
  out = {}

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        qualname = f"{prefix}{child.name}"
        if not isinstance(child, ast.ClassDef):
          lines = child.end_lineno - child.lineno + 1
          if lines > MAX_FUNCTION_LINES:
            out[(_rel(path), qualname)] = lines
        visit(child, qualname + ".")
      else:
        visit(child, prefix)

  visit(_tree(path), "")
  return out


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: pathlib.Path) -> set[tuple[str, str, int]]:
  """(file, "module.name", line) for each underscore name of another mpjax module it uses."""
  here = _module_name(path) if path.is_relative_to(PACKAGE) else None
  out = set()
  bound: dict[str, str] = {}  # a local name bound to an mpjax module -> that module
  for module, name, alias, line in _imports(path):
    target = _target(module, name)
    if name is None:  # import mpjax.x [as m]
      if alias is not None and target is not None:
        bound[alias] = target
      elif module.split(".")[0] == "mpjax":
        bound["mpjax"] = "mpjax"
    elif target is not None and target != module:  # from mpjax import x: a module
      bound[alias] = target
    elif target is not None and target != here and _private(name):
      out.add((_rel(path), f"{target}.{name}", line))
  for node in ast.walk(_tree(path)):
    if not isinstance(node, ast.Attribute):
      continue
    chain, inner = [node.attr], node.value
    while isinstance(inner, ast.Attribute):
      chain.insert(0, inner.attr)
      inner = inner.value
    if not isinstance(inner, ast.Name) or inner.id not in bound:
      continue
    module = bound[inner.id]
    for i, attr in enumerate(chain):
      if f"{module}.{attr}" in MODULES:
        module = f"{module}.{attr}"
        continue
      if i == len(chain) - 1 and module != here and _private(attr):
        out.add((_rel(path), f"{module}.{attr}", node.lineno))
      break
  return out


def _jax_src_imports(path: pathlib.Path) -> list[int]:
  lines = []
  for module, name, _, line in _imports(path):
    if module == "jax._src" or module.startswith("jax._src.") or (module, name) == ("jax", "_src"):
      lines.append(line)
  return lines


def _allowed(found, allowed, what):
  """Fails on a break not allowed, and on an allowance that nothing needs any more."""
  new = sorted(set(found) - set(allowed))
  stale = sorted(set(allowed) - set(found))
  assert not new, f"{what}: {new}"
  assert not stale, f"{what}: fixed, remove from the allow-list: {stale}"


def test_no_import_cycle_among_mpjax_modules():
  assert _cycles(import_graph()) == []


def test_no_module_over_700_lines():
  long = {
    _rel(p): n
    for p in MODULES.values()
    if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
  }
  _allowed(long, LONG_MODULES_ALLOWED, f"modules over {MAX_MODULE_LINES} lines {long}")


def test_no_function_over_120_lines():
  long = {k: v for p in MODULES.values() for k, v in _long_functions(p).items()}
  _allowed(long, LONG_FUNCTIONS_ALLOWED, f"functions over {MAX_FUNCTION_LINES} lines {long}")


def test_no_underscore_name_used_across_mpjax_modules():
  uses = {u for p in [*MODULES.values(), *SCRIPTS] for u in _private_uses(p)}
  found = {(file, name) for file, name, _ in uses}
  _allowed(found, PRIVATE_IMPORTS_ALLOWED, f"underscore names of other modules {sorted(uses)}")


def test_jax_src_only_in_jax_compat():
  found = {_rel(p): lines for p in MODULES.values() if (lines := _jax_src_imports(p))}
  assert set(found) <= {"mpjax/jax_compat.py"}, f"jax._src imported outside jax_compat: {found}"


@pytest.mark.parametrize(
  "source, expected",
  [
    ("from mpjax.gpu import _check_compiler\n", {"mpjax.gpu._check_compiler"}),
    ("import mpjax.gpu as g\ng._mesh('h100')\n", {"mpjax.gpu._mesh"}),
    ("import mpjax.gpu\nmpjax.gpu._PLUGINS\n", {"mpjax.gpu._PLUGINS"}),
    ("from mpjax import gpu\ngpu._PLUGINS\n", {"mpjax.gpu._PLUGINS"}),
    ("from mpjax import _backend\nfrom mpjax.gpu import PLUGIN as _P\n", set()),
    ("from mpjax.hlo import computations\nimport mpjax\nmpjax.__all__\n", set()),
  ],
)
def test_the_checks_see_underscore_names(tmp_path, source, expected):
  path = tmp_path / "script.py"
  path.write_text(source)
  assert {name for _, name, _ in _private_uses(path)} == expected


def test_the_checks_see_a_cycle_and_a_long_function(tmp_path):
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  path = PACKAGE / "gpu.py"  # a real module: no function over the limit...
  assert _long_functions(path) == {}
  long = tmp_path / "long.py"  # ...and a made-up one with one
  long.write_text("class A:\n  def f(self):\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
  assert list(_long_functions(long).values()) == [MAX_FUNCTION_LINES + 1]
