"""`mosaics eval paper-figure`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["paper-figure", *sys.argv[1:]]))
