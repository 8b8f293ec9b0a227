"""Files written whole or not at all (chains, plans, schedules, bench results)."""

from __future__ import annotations

import os
import secrets


def write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all: it goes to a new
    file beside ``path`` that is renamed over it. Written in place, a save that
    failed part-way (a full disk, Ctrl-C) left a truncated document, and the
    file it replaced, perhaps the very chain being planned (``rtmem plan remat
    c.json --save c.json``), was lost. The new file's permissions follow the
    umask, as ``open(path, "w")`` made them; a symbolic link's target is
    replaced, not the link."""
    target = os.path.realpath(os.fspath(path))
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
