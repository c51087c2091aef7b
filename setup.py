"""Everything is in pyproject.toml; this file only adds cplm_dist-lm_eval.pth to site-packages.

That .pth line lets the stock `lm_eval` command find `--model cplm` (lm-eval 0.4 has no plugin
entry points): cplm_dist/evaluation/lm_eval_plugin.py, which imports nothing until lm-eval is used.
It is added to regular and to editable installs (through setuptools' editable strategy, where it
has one; otherwise tools/lm_eval_cplm.py still registers the model itself).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "cplm_dist-lm_eval.pth"
LINE = "import cplm_dist.evaluation.lm_eval_plugin as _cplm_lm_eval; _cplm_lm_eval.install()\n"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH), "w") as f:
            f.write(LINE)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

try:  # editable installs write their own wheel: add the .pth next to the editable finder
    from setuptools.command.editable_wheel import editable_wheel

    if not hasattr(editable_wheel, "_select_strategy"):  # a setuptools that builds editables otherwise
        raise ImportError

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            strategy = super()._select_strategy(*args, **kwargs)

            class WithPth:
                def __enter__(self):
                    strategy.__enter__()
                    return self

                def __exit__(self, *exc):
                    return strategy.__exit__(*exc)

                def __call__(self, wheel, files, mapping):
                    strategy(wheel, files, mapping)
                    wheel.writestr(PTH, LINE.encode())

            return WithPth()

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:
    pass

setup(cmdclass=cmdclass)
