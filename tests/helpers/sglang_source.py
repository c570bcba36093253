"""SGLang's source, read from its release wheel: downloaded once into ``$BRIDLE_CACHE/wheels`` (default
``~/.cache/bridle/wheels``) with ``pip download``, checked against its PyPI digest, read as a zip, never installed.

The wheel is pinned to one file (CPython 3.11, x86-64 Linux) whatever machine runs the tests, so its digest is
fixed; the Python source inside is the same in every platform's wheel."""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

from pipeline.serving.sglang_api import SGLANG_VERSION

WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"  # PyPI's digest of WHEEL
DOWNLOAD_TIMEOUT_S = 240


def wheel_cache() -> Path:
    return Path(os.environ.get("BRIDLE_CACHE") or Path.home() / ".cache" / "bridle") / "wheels"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel() -> Path | str:
    """The cached wheel (downloaded first when missing), or why it could not be downloaded. A file whose digest
    is not PyPI's raises: that is not a network problem to skip over."""
    cache_dir = wheel_cache()
    path = cache_dir / WHEEL
    if path.is_file() and _digest(path) == SHA256:
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="download-", dir=cache_dir))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
               "manylinux_2_34_x86_64", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
               "--dest", str(tmp), f"sglang=={SGLANG_VERSION}"]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"pip download sglang=={SGLANG_VERSION} took over {DOWNLOAD_TIMEOUT_S}s"
        got = tmp / WHEEL
        if proc.returncode != 0 or not got.is_file():
            return f"could not download {WHEEL} (pip exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}"
        digest = _digest(got)
        if digest != SHA256:
            raise AssertionError(f"{WHEEL} downloaded with sha256 {digest}, PyPI's is {SHA256}: not the release")
        os.replace(got, path)  # atomic: a concurrent run sees the whole file or none
        return path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Source:
    """The ``sglang/`` package inside the wheel: files' text and their parsed syntax trees."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def version(self) -> str:
        meta = self.zip.read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode()
        return next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:"))

    def text(self, rel: str) -> str:
        name = f"sglang/{rel}"
        assert name in self.names, f"{name} is not in {WHEEL}: SGLang moved it; find where the checked code went"
        return self.zip.read(name).decode()

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            self._trees[rel] = ast.parse(self.text(rel), filename=f"sglang/{rel}")
        return self._trees[rel]

    def module(self, rel: str, *, drop_sglang_imports: bool = False) -> types.ModuleType:
        """Execute one self-contained file of the source as a private module (its ``from sglang...`` imports
        dropped when asked: the caller has checked they are not needed by what it calls)."""
        tree = self.tree(rel)
        if drop_sglang_imports:
            tree = ast.Module(
                body=[n for n in tree.body
                      if not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang"))],
                type_ignores=[],
            )
        name = "_bridle_sglang_" + rel.removesuffix(".py").replace("/", "_")
        mod = types.ModuleType(name)
        mod.__file__ = f"sglang/{rel}"
        sys.modules[name] = mod  # dataclasses and msgspec look a class's module up by name
        exec(compile(tree, f"sglang/{rel}", "exec"), mod.__dict__)  # noqa: S102 - the pinned release's own code
        return mod


# ------------------------------------------------------------------------------------------- syntax helpers
def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def find_function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def field_annotations(tree: ast.Module, name: str) -> dict[str, str]:
    """A dataclass's or Struct's fields (its bases' defined in the same file first) -> annotation source."""
    cls = find_class(tree, name)
    out: dict[str, str] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            out.update(field_annotations(tree, base.id))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            ann = ast.unparse(node.annotation)
            if not ann.startswith("ClassVar"):
                out[node.target.id] = ann
    return out


def fields(tree: ast.Module, name: str) -> set[str]:
    return set(field_annotations(tree, name))


def required_fields(tree: ast.Module, name: str) -> set[str]:
    """The fields without a default (a request must carry them)."""
    cls = find_class(tree, name)
    out: set[str] = set()
    for base in cls.bases:
        if isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            out |= required_fields(tree, base.id)
    return out | {n.target.id for n in cls.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is None}


def dict_keys(node: ast.AST) -> set[str]:
    """The constant string keys of every dict display under ``node``."""
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict)
            for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def keys_set_on(tree: ast.AST, var: str) -> set[str]:
    """Keys a function body puts in the dict named ``var``: ``var = {...}``, ``var["k"] = ...``,
    ``var.update({...})``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == var and isinstance(node.value, ast.Dict):
                    out |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == var
                        and isinstance(t.slice, ast.Constant)):
                    out.add(t.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == var and node.args
              and isinstance(node.args[0], ast.Dict)):
            out |= {k.value for k in node.args[0].keys if isinstance(k, ast.Constant)}
    return out


def routes(tree: ast.Module) -> dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef]:
    """FastAPI routes, (method, path) -> handler: ``@app.get(path)``, ``@app.post(path)``,
    ``@app.api_route(path, methods=[...])``."""
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                continue
            kind, path = dec.func.attr, dec.args[0].value
            if kind in ("get", "post", "put"):
                methods = [kind.upper()]
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = [e.value for e in kw["methods"].elts] if "methods" in kw else ["GET"]  # type: ignore[attr-defined]
            else:
                continue
            for m in methods:
                out[(m, path)] = node
    return out


def accepts(annotation: str, value: object) -> bool | None:
    """Whether a JSON value fits a simple field annotation (``str``, ``bool``, ``int``, ``float``, ``Literal[...]``,
    ``Optional[...]`` of those); None for an annotation this does not judge."""
    ann = ast.parse(annotation, mode="eval").body
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return True if value is None else accepts(ast.unparse(ann.slice), value)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Literal":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return value in [ast.literal_eval(e) for e in elts]
    kinds = {"str": (str,), "bool": (bool,), "int": (int,), "float": (int, float)}
    if isinstance(ann, ast.Name) and ann.id in kinds:
        return isinstance(value, kinds[ann.id]) and (ann.id == "bool" or not isinstance(value, bool))
    return None


def body_class(handler: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The class a FastAPI handler parses its JSON body into: ``obj: X`` or ``obj: Annotated[X, Body()]``."""
    for arg in handler.args.args:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        if isinstance(ann, ast.Name) and ann.id not in ("Request", "Response"):
            return ann.id
    raise AssertionError(f"handler {handler.name} takes no JSON body")
