"""`mosaics eval extrapolation`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["extrapolation", *sys.argv[1:]]))
