"""`mosaics eval routes`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["routes", *sys.argv[1:]]))
