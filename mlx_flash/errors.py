"""The one error type users see: a one-line message naming the file or flag and the reason."""


class FlashError(Exception):
    """Bad input or an unusable file. CLIs print `error: <message>` and exit with code 2."""
