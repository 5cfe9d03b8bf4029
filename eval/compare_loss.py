"""`mosaics eval compare-loss`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["compare-loss", *sys.argv[1:]]))
