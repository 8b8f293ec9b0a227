"""Files written whole or not at all (chains, plans, schedules, plots, bench results)."""

from __future__ import annotations

import os
import secrets


def replace_with(path, write) -> None:
    """Make ``path`` anew whole or not at all: ``write(tmp)`` writes the new
    content to ``tmp``, a new file beside ``path`` with the same extension
    (so a writer that picks its format by the extension, as matplotlib's
    ``savefig`` does, picks the same one), which is then renamed over
    ``path``. Written in place, a save that failed part-way (a full disk,
    Ctrl-C) left a truncated document, and the file it replaced, perhaps the
    very chain being planned (``rtmem plan remat c.json --save c.json``) or the
    plot of the previous run, was lost. ``tmp`` is removed if ``write`` raises.
    The new file's permissions follow the umask, as ``open(path, "w")`` made
    them; a symbolic link's target is replaced, not the link."""
    target = os.path.realpath(os.fspath(path))
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp{os.path.splitext(name)[1]}")
    # created here, exclusively: never someone else's file of that name
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all
    (:func:`replace_with`)."""
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    replace_with(path, write)
