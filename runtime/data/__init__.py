"""Training data: a memory-mapped token file, read in the same global batches whatever the plan.

Token files: ``.npy`` (uint16 or uint32 array), or raw little-endian tokens — ``.bin`` / ``.u16`` uint16 (the
nanoGPT convention), ``.u32`` uint32. A ``.txt`` file is tokenised at the byte level (vocabulary 256) into a
cached ``.u16`` file. Without ``--data`` the runtime trains on ``sample.txt`` beside this module: English
prose from the Python standard library's docstrings (regenerate with ``python -m runtime.data.make_sample``).

Sample ``j`` of the run is window ``perm_e[j mod n]`` of epoch ``e = j // n``, where the file is cut into
``n`` windows of ``seq + 1`` tokens (overlapping by one) and ``perm_e`` is a permutation seeded by
``(seed, e)``. Step ``k`` uses samples ``k*B .. k*B + B - 1``; dp rank ``r`` takes its contiguous ``B/dp``
rows, which its micro-batches split in order, and a context-parallel rank takes the columns (token positions)
it holds of every row, of the inputs and the targets alike (``positions``). So the global batch of a step never
depends on the plan, and resuming at step ``k`` needs nothing but ``k``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from specs.errors import AutoparError

SAMPLE_TEXT = Path(__file__).with_name("sample.txt")
_RAW = {".bin": np.uint16, ".u16": np.uint16, ".u32": np.uint32}
_CHUNK = 1 << 24  # tokens read at a time: the range check and the .txt tokeniser stream a file of any size
_SOURCE = ".source"  # beside a cached token file: the text file it was made from
CHECKED_ENV = "AUTOPAR_DATA_CHECKED"  # the launcher's verdict on the data file, for its workers (TokenData.verdict)


def cache_dir() -> Path:
    """The folder autopar keeps tokenised text and the default plan in: ``AUTOPAR_CACHE``, default
    ``~/.cache/autopar``."""
    return Path(os.environ.get("AUTOPAR_CACHE", Path.home() / ".cache" / "autopar"))


def writable_cache_dir() -> Path:
    """:func:`cache_dir`, made if missing; a one-line error when it cannot be made or written (a read-only home on a
    cluster, AUTOPAR_CACHE naming a file)."""
    d = cache_dir()
    if d.exists() and not d.is_dir():
        raise AutoparError(f"the cache folder {d} (AUTOPAR_CACHE) is a file; set AUTOPAR_CACHE to a writable folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as err:
        raise AutoparError(f"cannot write to the cache folder {d} ({err.strerror or type(err).__name__}); set "
                           "AUTOPAR_CACHE to a writable folder with room") from None
    return d


def tokenize_text(path: Path) -> Path:
    """Byte-level tokens of a text file, cached as ``<cache>/<name>-<hash>.u16`` (written atomically), the file read
    in chunks (a text of any size takes a chunk's memory); the tokens of its earlier versions are removed
    (:func:`_forget_earlier_versions`)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as err:
        raise AutoparError(f"cannot read data file {path}: {err.strerror}") from None
    out = cache_dir() / f"{path.stem}-{digest.hexdigest()[:12]}.u16"
    if out.exists():  # (a read-only cache that holds it will do)
        return out
    writable_cache_dir()
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(path, "rb") as f, open(tmp, "wb") as w:
            while chunk := f.read(_CHUNK):
                np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tofile(w)
        os.replace(tmp, out)
        _forget_earlier_versions(path, out)
    except OSError as err:
        with contextlib.suppress(OSError):  # (where nothing could be written, nothing is removed either)
            tmp.unlink(missing_ok=True)
        raise AutoparError(f"cannot write the tokens of {path} to the cache {out.parent} ({err.strerror}); set "
                           "AUTOPAR_CACHE to a folder with room") from None
    return out


def _forget_earlier_versions(text: Path, tokens: Path) -> None:
    """Record beside ``tokens`` (``<file>.source``) the text file they were made from, and remove the cached tokens
    of that file's earlier versions (other hashes, as recorded): a text edited and trained on again would otherwise
    leave a copy twice its size per version. (A run still reading one keeps its memory map; a restart of it finds
    its text changed, as it would anyway.)"""
    me = str(text.resolve())
    with contextlib.suppress(OSError):  # (a cache that took the tokens but not this: it only keeps more)
        Path(f"{tokens}{_SOURCE}").write_text(me)
    for side in tokens.parent.glob(f"{glob.escape(text.stem)}-*.u16{_SOURCE}"):
        old = Path(str(side)[:-len(_SOURCE)])
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if old != tokens and side.read_text() == me:
                old.unlink(missing_ok=True)
                side.unlink()


def open_tokens(path: str | Path) -> np.ndarray:
    """Memory-map a token file (see the module docstring for the formats); one-line errors."""
    p = Path(path)
    if not p.exists():
        raise AutoparError(f"data file {p} does not exist; give a token file (.npy, .bin/.u16, .u32) or a .txt file")
    if p.is_dir():
        raise AutoparError(f"data file {p} is a directory; give a token file (.npy, .bin/.u16, .u32) or a .txt file")
    if p.is_file() and p.stat().st_size == 0:  # np.memmap cannot map an empty file; name the user's file
        raise AutoparError(f"data file {p} is empty (0 tokens); give a file of tokens or text")
    suffix = p.suffix.lower()
    if suffix == ".txt":
        p, suffix = tokenize_text(p), ".u16"
    try:
        if suffix == ".npy":
            arr = np.load(p, mmap_mode="r")
            if not isinstance(arr, np.ndarray):  # np.savez's archive of several arrays
                raise AutoparError(f"data file {p} is an archive of several arrays (np.savez); save the tokens as one "
                                   "1-D array with np.save")
        elif suffix in _RAW:
            dtype = np.dtype(_RAW[suffix])
            if p.stat().st_size % dtype.itemsize:
                raise AutoparError(f"data file {p}: size {p.stat().st_size} bytes is not a whole number of "
                                   f"{dtype.name} tokens (truncated, or not a {dtype.name} token file?)")
            arr = np.memmap(p, dtype=dtype, mode="r")
        else:
            raise AutoparError(f"data file {p}: unknown format '{p.suffix}'; use .npy, .bin/.u16 (uint16), "
                               ".u32 (uint32) or .txt")
    except (ValueError, OSError, EOFError) as err:
        why = "not a .npy array of numbers" if "allow_pickle" in str(err) else str(err) or "empty or truncated"
        raise AutoparError(f"data file {p} cannot be read as tokens ({why})") from None
    if arr.dtype.byteorder == ">":
        raise AutoparError(f"data file {p} holds big-endian {arr.dtype.name} tokens; save them little-endian "
                           "(array.astype('<u2') or '<u4')")
    if arr.dtype not in (np.uint16, np.uint32, np.int32, np.int64) or arr.ndim != 1:
        raise AutoparError(f"data file {p}: expected a 1-D array of uint16/uint32 tokens, got {arr.dtype} {arr.shape}")
    return arr


def token_range(arr: np.ndarray) -> tuple[int, int]:
    """The smallest and largest token of ``arr`` (a memory map of a token file), read from the file in chunks: the
    whole file is checked before training, in a chunk's memory whatever its size (a mapped read would count every
    page in the process's resident memory)."""
    name, offset = getattr(arr, "filename", None), getattr(arr, "offset", 0)
    if name is None:
        return int(arr.min()), int(arr.max())
    lo, hi = None, None
    with open(name, "rb") as f:
        f.seek(offset)
        left = len(arr)
        while left:
            chunk = np.fromfile(f, dtype=arr.dtype, count=min(_CHUNK, left))
            if not chunk.size:
                break
            left -= chunk.size
            a, b = int(chunk.min()), int(chunk.max())
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))
    return (lo, hi) if lo is not None else (0, 0)


def _file_identity(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _launcher_verdict(path: Path) -> dict | None:
    """The launcher's verdict (``CHECKED_ENV``) where it is about this file unchanged since, else None."""
    raw = os.environ.get(CHECKED_ENV)
    if not raw:
        return None
    try:
        known = json.loads(raw)
        same = {k: known[k] for k in ("path", "size", "mtime_ns")} == _file_identity(path)
        tokens = Path(known["tokens"])
        lo, hi = known["range"]
    except (ValueError, KeyError, TypeError, OSError):
        return None
    return known if same and tokens.is_file() and isinstance(lo, int) and isinstance(hi, int) else None


class TokenData:
    """Fixed-length training windows from a token file, sampled deterministically (see module docstring)."""

    def __init__(self, path: str | Path, seq: int, vocab_size: int, seed: int) -> None:
        self.path, self.seq, self.vocab, self.seed = Path(path), seq, vocab_size, seed
        known = _launcher_verdict(self.path)  # the launcher read this very file already: its tokens and range
        self.tokens = open_tokens(known["tokens"] if known else path)
        self.windows = (len(self.tokens) - 1) // seq
        if self.windows < 1:
            raise AutoparError(f"data file {path} holds {len(self.tokens)} tokens, fewer than one sequence of "
                               f"{seq + 1}; use a larger file, or plan with a shorter sequence (autopar plan --seq N)")
        self.range = tuple(known["range"]) if known else token_range(self.tokens)
        self._check(*self.range)
        self._perm: dict[int, np.ndarray] = {}
        self._identity = _file_identity(self.path)

    def changed(self) -> str | None:
        """What became of the data file since it was read, where it was rewritten or removed (a run's memory map of
        it then reads past its end, a SIGBUS, or other tokens), or None."""
        try:
            now = _file_identity(self.path)
        except OSError:
            return f"data file {self.path} was removed while the run read it"
        if now == self._identity:
            return None
        size = (f" (size {self._identity['size']:,} -> {now['size']:,} bytes)" if now["size"] != self._identity["size"]
                else "")
        return f"data file {self.path} was rewritten while the run read it{size}"

    def verdict(self) -> str:
        """This file's check for the launcher to hand its workers (``CHECKED_ENV``): the file as it was when read
        (path, size, modification time), the token file it came to (a .txt file's cached tokens) and its range. A
        worker whose file still matches skips the whole-file read (one scan at start, not one per rank)."""
        tokens = Path(getattr(self.tokens, "filename", None) or self.path)  # (a memory map knows its file)
        return json.dumps({**self._identity, "tokens": str(tokens.resolve()), "range": list(self.range)})

    def _check(self, lo: int, hi: int) -> None:
        if lo < 0:
            raise AutoparError(f"data file {self.path} has token id {lo}: token ids are 0 or more; check how it was "
                               "written (a signed type that overflowed, or padding marked -1)")
        if hi >= self.vocab:
            raise AutoparError(f"data file {self.path} has token id {hi} but the model's vocabulary is "
                               f"{self.vocab}; tokenise for this model or pick a model with a larger vocabulary")

    def _window(self, j: int) -> int:
        epoch, i = divmod(j, self.windows)
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.windows)}
        return int(self._perm[epoch][i])

    def samples(self, start: int, count: int) -> np.ndarray:
        """Samples ``start .. start+count-1`` of the run as ``[count, seq + 1]`` int64 tokens."""
        starts = [self._window(j) * self.seq for j in range(start, start + count)]
        rows = [self.tokens[a:a + self.seq + 1] for a in starts]
        return np.stack(rows).astype(np.int64)

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp: int = 1,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's rows of step ``step``'s global batch: (inputs, targets), each ``[B/dp, seq]``, or only the
        tokens at ``positions`` of each row (``[B/dp, len(positions)]``; a context-parallel rank's)."""
        per = global_batch // dp
        rows = torch.from_numpy(self.samples(step * global_batch + dp_rank * per, per))
        inp, tgt = rows[:, :-1], rows[:, 1:]
        if positions is not None:
            inp, tgt = inp[:, positions], tgt[:, positions]
        return inp, tgt
