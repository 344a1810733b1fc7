"""A file of a save at a URL, sent in one ``fs.pipe_file`` at its end (``Upload``), and where it is
sent from inside ``executor.uploads_later()`` (``later``). ``storage`` names them too."""

from __future__ import annotations

import contextlib
import contextvars
import io
from typing import Any

# At a URL: the most bytes of one DCP file held in memory to be sent in one ``fs.pipe_file`` once
# written (s3fs sends a large one as concurrent parts); a larger file goes on as a streamed upload.
UPLOAD_BUFFER = 1 << 29


class Upload:
    """A file at a URL, written into memory and sent at ``close`` in one ``fs.pipe_file`` (one
    request, or s3fs's concurrent multipart upload), rather than streamed part after part; past
    ``limit`` bytes it goes on as fsspec's streamed upload (memory stays bounded). Nothing is
    uploaded before ``close``: ``discard`` leaves nothing behind (a streamed upload is aborted)."""

    def __init__(self, fs: Any, path: str, limit: int = UPLOAD_BUFFER) -> None:
        self.fs, self.path, self.limit = fs, path, limit
        self.buffer: io.BytesIO | None = io.BytesIO()
        self.stream: Any = None
        self.pos, self.closed = 0, False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.stream is None and self.buffer is not None and self.pos + n > self.limit:
            self.stream = self.fs.open(self.path, "wb")
            self.stream.write(self.buffer.getbuffer())
            self.buffer = None
        (self.stream if self.stream is not None else self.buffer).write(data)
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.close()
            return
        buffer, self.buffer = self.buffer, None
        assert buffer is not None
        sender = later.get()
        if sender is not None:  # inside ``executor.uploads_later()``: sent now, joined at its end
            sender.send(self.fs, self.path, buffer.getvalue())
            return
        self.fs.pipe_file(self.path, buffer.getvalue())

    def discard(self) -> None:
        """The write failed: nothing uploaded (a streamed upload aborted, or its object removed)."""
        self.closed, self.buffer = True, None
        stream, self.stream = self.stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.discard() if hasattr(stream, "discard") else stream.close()
            with contextlib.suppress(Exception):
                self.fs.rm_file(self.path)


# Inside ``executor.uploads_later()``: where ``Upload.close`` sends its upload (``send(fs, path, bytes)``).
later: contextvars.ContextVar[Any] = contextvars.ContextVar("hasten_uploads_later", default=None)
