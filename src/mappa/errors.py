"""One exception type for problems a user can fix (bad config, missing file, unknown name).

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class MappaError(Exception):
    """A user-facing error: the message names the file, field or line at fault."""
