"""`mosaics eval sweep`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["sweep", *sys.argv[1:]]))
