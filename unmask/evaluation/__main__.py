import sys

from unmask.evaluation.cli import main

sys.exit(main())
