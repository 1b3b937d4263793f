"""The host's reads of files that agents made: opened without following links, checked, bounded.

Agent code runs in the episode's workspace and its files are hostile input: a name may be a symbolic link to
a secret (`submission.csv -> /proc/self/environ`), a FIFO that blocks whoever opens it, or a file of
gigabytes. Every read of a workspace file by the trainer or a coach goes through `open_agent_file`:

    with open_agent_file(workspace, "submission.csv", max_bytes=1 << 20) as f:   # a binary file object
        header = f.readline(4096)
    data = read_agent_file(workspace, "notes.txt", max_bytes=65536)               # all of it, as bytes

The name is one entry of the workspace directory (no "/" or ".."); it must be a regular file with one link
and at most `max_bytes` bytes. It is opened relative to the workspace's directory descriptor with O_NOFOLLOW
and O_NONBLOCK, and what was opened is checked again (fstat), so a swap between the check and the open is
caught. Reads past `max_bytes` find the end of the file even when it grows. A refusal is an
`AgentFileError` whose message is a one-line reason that never quotes the file.

File names go into prompts through `bounded_names`: at most `MAX_LISTED` names, each printable and at most
`MAX_NAME_CHARS` long, and a last entry "... and K more"; `visible_names` first leaves out hidden files and caches.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from mappa.beneath import FileRefused, open_file

MAX_LISTED = 40  # file names a prompt or a coach's evidence shows of one list
MAX_NAME_CHARS = 100  # longer names are shown cut in the middle

_MORE = re.compile(r"\.\.\. and \d+ more")
# A refusal: its message is a one-line reason that never quotes the file, `kind` its class ("missing", "link",
# "not_regular", "too_large", "unreadable" or "name"). The checks are `mappa.beneath`'s, shared with `mappa serve`.
AgentFileError = FileRefused


def _open_checked(workspace: Path, name: str, max_bytes: int) -> int:
    """A descriptor of the regular file `name` directly inside `workspace`, after every check."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise AgentFileError("name", f"{name!r} is not a plain file name")
    try:
        dir_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise AgentFileError("missing", f"no {name} (no folder {workspace.name})") from None
    try:
        return open_file(dir_fd, name, name, max_bytes)[0]
    finally:
        os.close(dir_fd)


class _Capped(io.RawIOBase):
    """A read-only, seekable view of a descriptor that ends after `limit` bytes, however large the file grows."""

    def __init__(self, fd: int, limit: int) -> None:
        self._fd, self._limit, self._pos = fd, limit, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._limit - self._pos)
        if want <= 0:
            return 0
        data = os.pread(self._fd, want, self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._limit}[whence]
        self._pos = max(0, min(base + offset, self._limit))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@contextmanager
def open_agent_file(workspace: Path, name: str, max_bytes: int) -> Iterator[BinaryIO]:
    """The agent file `name` of `workspace` as a binary file object (see the module docstring for the checks)."""
    fd = _open_checked(Path(workspace), name, max_bytes)
    with io.BufferedReader(_Capped(fd, max_bytes)) as f:
        yield f  # type: ignore[misc]


def read_agent_file(workspace: Path, name: str, max_bytes: int) -> bytes:
    """All of the agent file `name` of `workspace` (at most `max_bytes` bytes); AgentFileError says why not."""
    with open_agent_file(workspace, name, max_bytes) as f:
        return f.read(max_bytes)


def shown(text: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """`text` on one line for a prompt or a reason: control characters escaped, cut in the middle if long."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) <= max_chars:
        return text
    half = max(max_chars // 2 - 2, 1)
    return f"{text[:half]}...{text[-half:]}"


def bounded_names(names: Iterable[str], keep: Collection[str] = (), limit: int = MAX_LISTED) -> list[str]:
    """At most `limit` of `names` in their order, those in `keep` always among them, each as `shown` makes it,
    then "... and K more" when some were left out. A list this made comes back unchanged."""
    names = list(names)
    if len(names) <= limit + 1 and names and _MORE.fullmatch(names[-1]):
        return names
    if len(names) <= limit:
        return [n if n in keep else shown(n) for n in names]
    room = limit - sum(n in keep for n in names)
    picked: list[str] = []
    for n in names:
        if n in keep:
            picked.append(n)
        elif room > 0:
            picked.append(shown(n))
            room -= 1
    return [*picked, f"... and {len(names) - len(picked)} more"]


def visible_names(names: Iterable[str]) -> tuple[str, ...]:
    """The workspace files (relative paths) as agents are shown them: sorted, without hidden files and caches
    (HOME points into the workspace, so libraries may leave `.cache` and `.config` there)."""
    return tuple(sorted(n for n in set(names) if not _hidden(n)))


def _hidden(name: str) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in Path(name).parts)
