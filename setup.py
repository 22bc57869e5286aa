"""Build hook for the CPU kernels (mlx_flash._ext); all metadata lives in pyproject.toml.

`pip install .` runs CMake on kernels/ against the mlx wheel in the build environment. A failed
kernel build fails the install (a broken build must not pass for a working one). Without a C++
compiler or CMake, MLX_FLASH_SKIP_KERNELS=1 installs the package without the kernels: mlx_flash
then runs MLX's own ops (slower) and says so once at run time; the test suite needs the same
variable to run without them.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name, source_dir):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if os.environ.get("MLX_FLASH_SKIP_KERNELS") == "1":
            print("mlx_flash: MLX_FLASH_SKIP_KERNELS=1: CPU kernels not built; mlx_flash will use the "
                  "slower MLX-op path.", file=sys.stderr)
            return
        try:
            self._cmake(ext)
        except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
            if isinstance(exc, subprocess.CalledProcessError):
                reason = "`" + " ".join(map(str, exc.cmd[:3])) + f"` exited with {exc.returncode}"
            else:
                reason = str(exc)
            sys.exit(f"error: mlx_flash CPU kernels failed to build ({reason}; the compiler output is "
                     "above). Fix the build, or set MLX_FLASH_SKIP_KERNELS=1 to install without them.")

    def _cmake(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "mlx_flash_ext"
        build_dir.mkdir(parents=True, exist_ok=True)
        config = [
            "cmake", ext.source_dir,
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMLX_FLASH_OUTPUT_DIR={out_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        jobs = str(os.cpu_count() or 1)
        subprocess.run(config, cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = out_dir / f"_ext{suffix}"
        if not built.exists():
            raise RuntimeError(f"CMake finished but {built} is missing")

    def copy_extensions_to_source(self):
        # --inplace: skip the extension when MLX_FLASH_SKIP_KERNELS=1 left it unbuilt.
        for ext in self.extensions:
            src = Path(self.build_lib) / self.get_ext_filename(self.get_ext_fullname(ext.name))
            if src.exists():
                super().copy_extensions_to_source()
                return

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]


setup(
    ext_modules=[CMakeExtension("mlx_flash._ext", ROOT / "kernels")],
    cmdclass={"build_ext": CMakeBuild},
)
