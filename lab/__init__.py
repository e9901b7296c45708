"""The lab: the research instruments built on the lesson (model.py, train.py). Its scripts run from the repository
root as modules, e.g. `python -m lab.sweep --mode=exponent`."""
