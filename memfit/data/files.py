"""Atomic file writes: a reader sees the old file or the whole new one, never half of either.

Every file memfit writes (plans, timelines, PNGs, the benchmark's RESULTS.md) goes through
``replacing``: the content is written to a temporary file beside the target and moved over it
with ``os.replace`` only once it is complete. An exception, a full disk or a killed process
midway leaves the old file as it was (and at worst a stray hidden ``.name.*`` file beside it).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error, move it there.

    The temporary name keeps ``path``'s suffix, so writers that pick a format by extension
    (matplotlib's ``savefig``) write the right one. It is created with the mode a plain
    ``open(path, "w")`` would give (``0o666`` less the umask), unlike ``tempfile``'s ``0o600``.

    Raises:
        whatever the block raises; the temporary file is removed and ``path`` is untouched.

    Example:
        >>> with replacing("memory.png") as temporary:
        ...     figure.savefig(temporary)
    """
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}{target.suffix}")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield temporary
        with open(temporary, "rb") as written:  # on disk before it takes the old file's place
            os.fsync(written.fileno())
        os.replace(temporary, target)
    except BaseException:
        with suppress(OSError):
            temporary.unlink()
        raise


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: see ``replacing``."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


CACHE_OFF_VALUES = ("0", "false", "off", "no")


def cache_dir() -> Path | None:
    """The folder memfit keeps what it computed for later processes in (plans, kernel
    measurements): ``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit`` (``~/.cache/memfit``);
    ``None`` where ``MEMFIT_CACHE=0`` turns it off. Read at each call, so a test or a script may
    change it."""
    if os.environ.get("MEMFIT_CACHE", "1").strip().lower() in CACHE_OFF_VALUES:
        return None
    given = os.environ.get("MEMFIT_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memfit"
