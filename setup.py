"""Build hook for the optional CPU kernels (mlx_flash._ext); all metadata lives in pyproject.toml.

`pip install .` runs CMake on kernels/ against the mlx wheel in the build environment. If that fails
(no compiler, no cmake, unsupported platform) the package still installs and mlx_flash.ops falls back
to MLX ops, saying so once at run time. MLX_FLASH_SKIP_KERNELS=1 skips the build on purpose.
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
            self._warn("MLX_FLASH_SKIP_KERNELS=1")
            return
        try:
            self._cmake(ext)
        except Exception as exc:  # the pure-Python package must install anyway
            self._warn(exc)

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
        # --inplace: CMake already wrote into the package directory; skip what was not built.
        for ext in self.extensions:
            src = Path(self.build_lib) / self.get_ext_filename(self.get_ext_fullname(ext.name))
            if src.exists():
                super().copy_extensions_to_source()
                return

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]

    @staticmethod
    def _warn(reason):
        print(
            f"WARNING: mlx_flash CPU kernels were not built ({reason}); "
            "mlx_flash will use the slower MLX-op path.",
            file=sys.stderr,
        )


setup(
    ext_modules=[CMakeExtension("mlx_flash._ext", ROOT / "kernels")],
    cmdclass={"build_ext": CMakeBuild},
)
