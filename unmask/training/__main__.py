"""`python -m unmask.training ...`: the same as `unmask train ...`."""

from unmask.training.train import main

main()
