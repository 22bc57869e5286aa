"""Which BLAS MLX's float32 CPU ops run on, and OpenBLAS preloaded for the float32 commands.

MLX's Linux wheel bundles the reference BLAS: a float32 1024^3 matmul runs at 3.0 GFLOP/s on it
against 84.5 with OpenBLAS (docs/benchmarks.md, "BLAS on Linux"); `calibrate` on the embedded
model's pack took 394 s instead of 115 s (1024 tokens). A shared library can only be swapped
before the process loads it, so the commands whose work is float32 (calibrate, eval, relufy,
moefy, prune, convert with calibration text) call `preload_openblas` once their arguments parse:
on Linux, with OpenBLAS installed and not yet preloaded, the command restarts itself once (the
same interpreter, arguments and process id, os.execve) with LD_PRELOAD naming it, saying so in
one stderr line with --verbose (without it, a bad argument found after the restart still gets its
one `error:` line and nothing else). MLX_FLASH_PRELOAD_BLAS=0 turns this off; MLX_FLASH_OPENBLAS=PATH names the
library to preload (default: Debian's and Ubuntu's libopenblas0-pthread,
/usr/lib/<multiarch>/openblas-pthread/libblas.so.3).
"""

import os
import platform
import sys
import sysconfig

RESTARTED = "MLX_FLASH_BLAS_RESTARTED"  # set in the restarted process: never restart twice


def openblas_path() -> str | None:
    """The OpenBLAS library to preload: MLX_FLASH_OPENBLAS, else Debian's libopenblas0-pthread
    path for this machine's multiarch triplet; None when that file does not exist."""
    path = os.environ.get("MLX_FLASH_OPENBLAS")
    if not path:
        triplet = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
        path = f"/usr/lib/{triplet}/openblas-pthread/libblas.so.3"
    return path if os.path.isfile(path) else None


def loaded_blas() -> str:
    """The BLAS libraries mapped into this process (Linux: from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "blas" in line.lower()}
    except OSError:
        return "unknown (no /proc/self/maps)"
    return ", ".join(sorted(libs)) or "none found"


def restart_plan(environ, platform_name: str) -> tuple | None:
    """(library, new environment) when this process should restart with OpenBLAS preloaded, else
    None: not Linux, turned off, restarted once already, no OpenBLAS installed, or already in
    LD_PRELOAD."""
    if platform_name != "linux" or environ.get("MLX_FLASH_PRELOAD_BLAS", "1").strip() == "0" \
            or environ.get(RESTARTED):
        return None
    lib = openblas_path()
    preload = environ.get("LD_PRELOAD", "")
    if lib is None or lib in preload.replace(":", " ").split():
        return None
    return lib, {**environ, "LD_PRELOAD": f"{lib} {preload}".strip(), RESTARTED: "1"}


def preload_openblas(argv) -> None:
    """Restart this command with OpenBLAS preloaded (module docstring) when `argv` is None (the
    process's own command line; a caller passing arguments, as tests do, is never restarted)."""
    if argv is not None:
        return
    plan = restart_plan(os.environ, sys.platform)
    if plan is None:
        return
    lib, env = plan
    if "--verbose" in sys.argv[1:]:
        print(f"mlx_flash: float32 work: restarting with LD_PRELOAD={lib} (OpenBLAS; "
              f"MLX_FLASH_PRELOAD_BLAS=0 turns this off)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
