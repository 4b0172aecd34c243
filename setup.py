"""Packaging hook: installs `hf_stable_launcher.pth` next to the package, in the wheel and in editable installs.

Everything else about the package is in pyproject.toml. The .pth line runs at every Python start (that is what a
.pth import line is for), so it only compares argv and one environment variable, and imports
`hf_stable.launcher` only in an `accelerate launch` / `torchrun` process or in a worker such a launcher started.
Why the launcher needs code of ours at all: see `hf_stable/launcher.py`.

setuptools has no option for a top-level data file in site-packages, hence the two command overrides:
`build_py` puts the file at the root of the wheel; `editable_wheel` (`pip install -e .`) wraps the editable
strategy so the same file is written into the editable wheel too.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "hf_stable_launcher.pth"
# One line, never raises (a .pth that raises prints a traceback at every Python start).
PTH_LINE = (
    "import os, sys; exec('try:\\n import hf_stable.launcher as _hf\\nexcept Exception:\\n pass\\nelse:\\n "
    "_hf.startup()') if (os.environ.get('HF_STABLE_LAUNCHER_PID') == str(os.getppid()) or any(os.path.basename(a) "
    "in ('accelerate', 'accelerate-launch', 'torchrun', 'torch.distributed.run', 'accelerate.commands.launch', "
    "'accelerate.commands.accelerate_cli') for a in (getattr(sys, 'orig_argv', None) or [])[:4])) else None\n"
)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        Path(self.build_lib, PTH_NAME).write_text(PTH_LINE, encoding="utf-8")

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH_NAME))]


class _StrategyWithPth:
    """The editable strategy setuptools picked (a path finder), plus our .pth file in the same wheel."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH_NAME, PTH_LINE.encode("utf-8"))

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, name, tag, build_lib):
        return _StrategyWithPth(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
