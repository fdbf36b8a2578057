# lm-eval imports this file for the YAMLs' `!function utils.NAME`; the code lives in the package.
from unmask.evaluation.tasks import (  # noqa: F401
    gsm8k_dataset,
    gsm8k_results,
    math_dataset,
    math_results,
)
