"""The lab: the research instruments built on the lesson (model.py, train.py). Its scripts run from the repository
root as modules, e.g. `python -m lab.sweep --mode=exponent`. The packages they need beyond the lesson's install with
`pip install -r requirements-lab.txt`; the lab modules that train.py and sample.py import need only the lesson's."""

import importlib

from configurator import die


def require(*packages):
    """Import each of the lab's packages named, or stop with one line that names the file installing them: the
    lesson's requirements.txt leaves them out."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as e:
            die(f"this needs {package}, one of the lab's packages ({e}): pip install -r requirements-lab.txt")
