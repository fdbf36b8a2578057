"""Build hooks (the rest of the build is in pyproject.toml): install ``unmask_lm_eval.pth`` at
the root of site-packages, so that plain ``lm_eval --model unmask`` works (_unmask_lm_eval.py
says how).

- wheel (``pip install .``, ``python -m build``): a ``build`` sub-command writes the .pth at the
  root of ``build_lib``, which is the root of the wheel, so pip puts it in site-packages and
  lists it in RECORD (uninstalled with the package).
- editable (``pip install -e .``, PEP 660): setuptools builds the editable wheel from its own
  ``.pth``/finder and leaves out what build sub-commands write, so ``editable_wheel`` adds the
  .pth to the wheel it made (with its RECORD line).
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.command.editable_wheel import editable_wheel

# Sorts after setuptools' __editable__.*.pth, whose finder is what finds the module in an
# editable install (site reads .pth files in name order).
PTH_NAME = "unmask_lm_eval.pth"
# site runs a .pth line that starts with `import`. A missing module (an editable install whose
# checkout is gone) is skipped quietly instead of a traceback at every interpreter start.
PTH_LINE = ('import sys; exec("try: import _unmask_lm_eval as m\\nexcept ImportError: m = None\\n'
            'm and m.install()", {})\n')


class build_pth(Command):
    """Write ``unmask_lm_eval.pth`` at the root of build_lib (a build sub-command)."""

    description = f"write {PTH_NAME} at the root of build_lib"
    user_options: list = []
    editable_mode = False

    def initialize_options(self) -> None:
        self.build_lib = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        if self.editable_mode:  # editable_wheel adds it (see below)
            return
        os.makedirs(self.build_lib, exist_ok=True)
        Path(self.build_lib, PTH_NAME).write_text(PTH_LINE, encoding="utf-8")

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else [os.path.join(self.build_lib, PTH_NAME)]

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


class build_with_pth(build):
    sub_commands = [*build.sub_commands, ("build_pth", None)]


class editable_wheel_with_pth(editable_wheel):
    """setuptools' editable wheel, plus ``unmask_lm_eval.pth`` at its root."""

    def run(self) -> None:
        before = set(Path(self.dist_dir).glob("*.whl")) if self.dist_dir else set()
        super().run()
        made = set(Path(self.dist_dir).glob("*.whl")) - before
        if len(made) != 1:
            raise RuntimeError(f"expected one editable wheel in {self.dist_dir}, found {sorted(made)}")
        add_to_wheel(made.pop(), PTH_NAME, PTH_LINE.encode("utf-8"))


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with ``name`` (``data``) added at its root and listed in its RECORD."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(i.filename for i in src.infolist()
                      if i.filename.endswith(".dist-info/RECORD") and i.filename.count("/") == 1)
        for item in src.infolist():
            if item.filename == name:
                raise RuntimeError(f"{wheel.name} already has {name}")
            if item.filename != record:
                dst.writestr(item, src.read(item))
        dst.writestr(name, data)
        lines = src.read(record).decode("utf-8").splitlines()
        lines.insert(len(lines) - 1 if lines and lines[-1].startswith(record) else len(lines),
                     f"{name},sha256={digest},{len(data)}")
        dst.writestr(record, "\n".join(lines) + "\n")
    os.replace(tmp, wheel)


setup(cmdclass={"build": build_with_pth, "build_pth": build_pth,
                "editable_wheel": editable_wheel_with_pth})
