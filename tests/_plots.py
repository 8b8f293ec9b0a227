"""A plot save that fails half-way, for the tests of files written whole or not
at all (``rtmem._files.replace_with``)."""

from __future__ import annotations

import io
import os


def fail_saves_half_way(monkeypatch, failure: BaseException) -> None:
    """Make every PIL image save to a path write half the image, then raise
    ``failure``, as a full disk or a Ctrl-C part-way does (PIL opens the file,
    then writes). Saves to file objects (matplotlib's dry runs) are untouched."""
    from PIL import Image
    real = Image.Image.save

    def half_written(self, fp, format=None, **params):
        if not isinstance(fp, (str, os.PathLike)):
            return real(self, fp, format, **params)
        whole = io.BytesIO()
        real(self, whole, format or "png", **params)
        with open(fp, "wb") as f:
            f.write(whole.getvalue()[:len(whole.getvalue()) // 2])
        raise failure
    monkeypatch.setattr(Image.Image, "save", half_written)
