"""Files: reading YAML/JSON mappings with one-line errors, and output paths checked before long work starts
(so a bad one fails in a second and not after the work)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from specs.errors import AutoparError


def utc_now() -> str:
    """The time a file is written, as plan files and profiles record it: UTC, to the second, ISO 8601."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(path: str | Path, what: str, inputs: dict[str, str | Path | None] | None = None,
                      instead: str = "give another file name", replaces: Callable[[Any], bool] | None = None) -> Path:
    """``path`` can be written as a file: not a directory, not one of the command's ``inputs`` (what each is ->
    its path; writing there would destroy it: the error says to do ``instead``), not a file of another kind than
    it writes (``replaces`` says of a file's YAML/JSON content whether it is one of its kind; an empty file is
    any kind), and its folder exists or can be created."""
    p = Path(path)
    if not str(path):
        raise AutoparError(f"the {what} path is empty; give a file name")
    if p.is_dir():
        raise AutoparError(f"{what} {p} is a directory; give a file name inside it")
    if str(path).endswith(("/", os.sep)):
        raise AutoparError(f"{what} {path} names a folder (it ends in /); give a file name inside it")
    for name, src in (inputs or {}).items():
        if src is not None and str(src) and _same_file(p, Path(src)):
            raise AutoparError(f"{what} {p} is the {name} this command reads: writing it would destroy it; "
                               f"{instead}")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise AutoparError(f"cannot write {what} {p}: permission denied")
        if replaces is not None and p.is_file() and p.stat().st_size and not replaces(file_content(p)):
            raise AutoparError(f"{p} exists and is not a {what}: writing the {what} there would destroy it; give "
                               "another file name (or delete it first)")
        return p
    _check_creatable(p.parent if str(p.parent) else Path("."), p, what)
    return p


def _check_creatable(folder: Path, target: Path, what: str) -> None:
    """``folder`` exists and is writable, or its nearest existing ancestor is a writable folder: permissions say so,
    and a uniquely named folder can be made there and removed (permissions can say yes where the file system says
    no: /proc, as root); ``target`` itself is never touched."""
    existing = next(a for a in (folder, *folder.absolute().parents) if a.exists())
    if not existing.is_dir():
        raise AutoparError(f"cannot write {what} {target}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AutoparError(f"cannot write {what} {target}: permission denied on {existing}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".autopar-probe-", dir=existing))
    except OSError as err:
        raise AutoparError(f"cannot write {what} {target}: nothing can be created in {existing} "
                           f"({err.strerror})") from None


def file_content(p: Path) -> Any:
    """What a file holds (:func:`text_content`), None when it cannot be read as text."""
    try:
        return text_content(p.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def text_content(text: str) -> Any:
    """A file's text read as YAML (JSON is YAML too), or the text itself when it is not YAML (a file cut short)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def check_output_dir(path: str | Path, what: str) -> Path:
    """``path`` is a writable directory, or can be created as one (nothing is left behind)."""
    p = Path(path)
    if not str(path):
        raise AutoparError(f"the {what} path is empty; give a folder name")
    if p.exists() and not p.is_dir():
        raise AutoparError(f"{what} {p} exists and is not a folder; give a folder path")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise AutoparError(f"cannot write {what} {p}: " + (
                "it is on a read-only file system; give a folder on a writable one" if _read_only(p)
                else f"permission denied on {p}; give a folder you can write"))
        return p
    _check_creatable(p, p, what)
    return p


def _read_only(p: Path) -> bool:
    """Whether ``p`` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class DuplicateKey(ValueError):
    """A mapping names one key twice (YAML and JSON parsers would keep the last silently)."""

    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives one key twice (merged keys, ``<<: *anchor``, may be
    overridden), and reading ``1e-5`` as a number (YAML 1.1's float needs a dot; the value is meant as one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
            except TypeError:  # an unhashable key: the parent's own one-line error
                pass
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
# Switches are true or false: YAML 1.1 (PyYAML) also reads yes/no/on/off as booleans, which would turn a misspelt
# value into a silent switch; such words stay text here, and the specs' boolean fields refuse them in one line.
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _UniqueKeyLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                       list("tTfF"))


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook refusing a key given twice."""
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise DuplicateKey(k)
        seen.add(k)
    return dict(pairs)


def parse_json(text: str) -> Any:
    """json.loads, refusing an object that gives one key twice (:class:`DuplicateKey`)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


def duplicate_text(err: DuplicateKey) -> str:
    """The one-line reason for a key given twice."""
    where = f" (the second at line {err.line})" if err.line else ""
    return f"gives '{err.key}' twice{where}; keep one"


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename: a reader (or a crash)
    never sees half a file, and an old file stays whole until the new one is. A symbolic link is written through
    (its target replaced), an old file keeps its permissions, and what is not a regular file (/dev/stdout, a pipe)
    is written directly."""
    p = Path(path).resolve() if Path(path).is_symlink() else Path(path)
    if p.exists() and not p.is_file():
        p.write_text(text)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, p.stat().st_mode & 0o7777 if p.exists() else 0o666 & ~_umask())
        os.replace(tmp, p)
    finally:
        Path(tmp).unlink(missing_ok=True)


def default_mode(path: Path) -> None:
    """Give ``path`` the mode a new file gets here (0666 less the umask), for writers that make private files."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping, with a one-line error for every way it can be wrong."""
    if path.exists() and not path.is_file():  # a pipe or device would block or never end
        raise AutoparError(f"{what} {path} is not a regular file; give a YAML or JSON file")
    try:
        text = path.read_text()
    except OSError as err:
        raise AutoparError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise AutoparError(f"{what} {path} is not a text file (not UTF-8); give a YAML or JSON file") from None
    is_json = path.suffix == ".json"
    text = text.removeprefix("\ufeff")  # a byte-order mark (Windows editors write one): YAML skips it, and JSON here
    fields = ('a JSON object of fields (`{"key": value, ...}`)' if is_json
              else "a mapping of fields (`key: value` lines)")
    if is_json and not text.strip():  # (json would call it invalid at its end)
        raise AutoparError(f"{what} {path} is empty; write {fields}")
    try:
        data = parse_json(text) if is_json else yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
    except DuplicateKey as err:
        raise AutoparError(f"{what} {path} {duplicate_text(err)}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else (
            f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else "")
        kind = "JSON" if is_json else "YAML"
        raise AutoparError(f"{what} {path} is not valid {kind}{where}; fix the syntax") from None
    if data is None and not is_json:  # (YAML reads a file of nothing, or of comments only, as null)
        raise AutoparError(f"{what} {path} is empty; write its fields (`key: value` lines)")
    if not isinstance(data, dict):
        shown = {"list": "a list", "str": "text", "int": "a number", "float": "a number", "bool": "true/false",
                 "NoneType": "null"}.get(type(data).__name__, type(data).__name__)
        raise AutoparError(f"{what} {path} must hold {fields}, not {shown}")
    return data


def path_argument(text: str) -> str:
    """argparse type of path-like arguments: an empty one is an error, not a silently skipped output."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def integer(text: str) -> int:
    """argparse type of whole-number arguments: ASCII digits with an optional sign (int() would also take ``1_0``
    and other scripts' digits)."""
    from specs.parallel import whole_number

    try:
        return whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
