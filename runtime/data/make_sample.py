"""Regenerate ``sample.txt``: English prose from the Python standard library's docstrings.

``python -m runtime.data.make_sample`` keeps paragraphs of at least 80 characters that are ASCII, nearly
all letters and spaces and free of doctest examples, wraps them at 100 columns and writes them in a fixed
module order. (The shipped file was made with Python 3.11; other versions give slightly different text.)
"""

from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from pathlib import Path

MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "cmd", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "imaplib",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "mimetypes", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "sqlite3", "statistics", "string",
    "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom",
    "zipfile", "zoneinfo",
)


def paragraphs(doc: object, seen: set[str]) -> list[str]:
    if not isinstance(doc, str) or not doc:
        return []
    out = []
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        para = " ".join(para.split())
        if len(para) < 80 or para in seen or ">>>" in para or not para.isascii():
            continue
        if sum(c.isalpha() or c == " " for c in para) / len(para) < 0.85:
            continue
        seen.add(para)
        out.append(textwrap.fill(para, 100))
    return out


def build() -> str:
    seen: set[str] = set()
    out: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        out += paragraphs(mod.__doc__, seen)
        for _, obj in sorted(vars(mod).items()):
            ours = getattr(obj, "__module__", None) == mod.__name__
            if not ours or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            out += paragraphs(obj.__doc__, seen)
            if inspect.isclass(obj):
                for _, fn in sorted(vars(obj).items()):
                    if inspect.isfunction(fn):
                        out += paragraphs(fn.__doc__, seen)
    return "\n\n".join(out) + "\n"


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    target = Path(__file__).with_name("sample.txt")
    target.write_text(build())
    print(f"wrote {target} ({target.stat().st_size} bytes)")
