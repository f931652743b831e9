"""The code's layering stays clean: no import cycle among glmcore's, the plugins' and the conformance
suite's modules (lazy imports inside functions count too), and no module imports another's private name."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"glmcore": "glmcore", "glmcore_plugins": "plugins", "glmcore_conformance": "conformance"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def imports(name: str, path: Path, known: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement, resolved to known modules."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parent = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
                module = f"{parent}.{module}" if module else parent
            names = [a.name for a in node.names]
            for sub in names:                    # `from pkg import module`
                if f"{module}.{sub}" in known:
                    found.append((f"{module}.{sub}", []))
            if module in known:
                found.append((module, [n for n in names if f"{module}.{n}" not in known]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in known]
    return [(m, names) for m, names in found if m != name]


def test_no_import_cycles():
    known = modules()
    # a package importing its own submodules (or the reverse) is how packages are built, not a cycle
    graph = {m: {d for d, _ in imports(m, p, known) if not (d.startswith(m + ".") or m.startswith(d + "."))}
             for m, p in known.items()}
    cycles, state = [], {}

    def visit(m, trail):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(trail[trail.index(d):] + [d])
            elif d not in state:
                visit(d, trail + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_imports_a_private_name_of_another():
    known = modules()
    private = [f"{m} imports {n} from {d}" for m, p in known.items() for d, names in imports(m, p, known)
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, private
