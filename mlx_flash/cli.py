"""What every CLI of ours shares: one-line errors with exit code 2, tracebacks only with --verbose."""

import sys
import traceback

from .errors import FlashError, from_kernel


def run_cli(main_body, argv, verbose_flag="--verbose"):
    """Run `main_body(argv)`; turn user errors into `error: ...` on stderr and exit code 2."""
    verbose = argv is not None and verbose_flag in argv or (argv is None and verbose_flag in sys.argv)
    try:
        return main_body(argv)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except (FlashError, FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and from_kernel(e) is None:
            raise
        if verbose:
            traceback.print_exc()
        print(f"error: {from_kernel(e) or e}", file=sys.stderr)
        sys.exit(2)


def refuse_flags(argv, flags, why: str) -> None:
    """FlashError for the first of `flags` given in `argv` (as `--flag value` or `--flag=value`)."""
    for flag in flags:
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise FlashError(f"{flag}: {why}")
