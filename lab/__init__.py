"""The lab: the research instruments built on the lesson (model.py, train.py). Its scripts run from the repository
root as modules, e.g. `python -m lab.sweep --mode=exponent`. The packages they need beyond the lesson's install with
`pip install -r requirements-lab.txt`; the lab modules that lab.train and lab.sample run the lesson's scripts with
need only the lesson's."""

from configurator import require  # noqa: F401  (the lab's scripts import it from here)
