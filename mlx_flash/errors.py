"""The one error type users see: a one-line message naming the file or flag and the reason."""

# What a kernel's error message starts with when its cause is a pack's bytes (a checksum mismatch,
# a truncated file) found while MLX evaluates a graph: MLX hands it on as a RuntimeError.
BAD_PACK = "mlx_flash: bad pack: "


class FlashError(Exception):
    """Bad input or an unusable file. CLIs print `error: <message>` and exit with code 2."""


def from_kernel(error: BaseException) -> "FlashError | None":
    """The FlashError a kernel's RuntimeError stands for (its message starts with BAD_PACK), or None."""
    text = str(error)
    return FlashError(text[len(BAD_PACK):]) if isinstance(error, RuntimeError) and text.startswith(BAD_PACK) else None
