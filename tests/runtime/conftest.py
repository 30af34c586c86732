"""Fixtures of the runtime tests: one pool of 8 gloo workers for the whole session, a token file."""

from __future__ import annotations

from multiprocessing import forkserver
from pathlib import Path

import numpy as np
import pytest
from rt_pool import WorkerPool

SAMPLE = Path(__file__).resolve().parents[2] / "runtime" / "data" / "sample.txt"


@pytest.fixture(autouse=True)
def _token_cache(tmp_path_factory, monkeypatch):
    """Tokenised text files go to a temporary cache, not ~/.cache/autopar."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path_factory.getbasetemp() / "autopar-cache"))


@pytest.fixture(scope="session")
def pool():
    p = WorkerPool(8)
    yield p
    p.close()
    stop = getattr(forkserver._forkserver, "_stop", None)  # reap the fork server here rather than leave it to init
    if stop is not None:
        stop()


@pytest.fixture(scope="session")
def tokens64(tmp_path_factory) -> str:
    """Real text folded into a 64-token vocabulary, as a raw uint16 token file."""
    path = tmp_path_factory.mktemp("data") / "text64.u16"
    raw = np.frombuffer(SAMPLE.read_bytes()[:60000], dtype=np.uint8)
    (raw % 64).astype(np.uint16).tofile(path)
    return str(path)
